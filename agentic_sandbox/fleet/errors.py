"""Errors the fleet raises. Callers never see a raw ``libvirt.libvirtError``."""

from __future__ import annotations


class FleetError(Exception):
    """Base class. ``stage`` names the step that failed (e.g. ``overlay``, ``define``)."""

    def __init__(self, message: str, *, stage: str | None = None) -> None:
        super().__init__(message)
        self.stage = stage


class InvalidRequest(FleetError):
    """The request cannot be satisfied as given (bad value, wrong state)."""


class NotFound(FleetError):
    """No such instance, host, snapshot or saved state."""


class Conflict(FleetError):
    """The name is taken by something different."""


class HostUnavailable(FleetError):
    """The host cannot be reached right now."""


class NoCapacity(FleetError):
    """No host satisfies the placement request."""


class LibvirtFailure(FleetError):
    """libvirt refused or failed; the message carries libvirt's own text."""
