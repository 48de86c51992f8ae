"""The instance index: what the fleet knows of each instance, a cache of the hosts' truth.

Each instance's record lives with its domain (libvirt: in the domain's ``<metadata>``); the
index is rebuilt by reconciliation and kept current by lifecycle events. It also knows which
domains are being made or removed right now (``inflight``), so events and reconciliation leave
those alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from .context import FleetContext
from .errors import Conflict, InvalidRequest, NotFound
from .models import FleetEventKind, Instance, InstanceRecord, InstanceState


@dataclass
class Entry:
    record: InstanceRecord
    state: InstanceState
    uuid: str = ""
    reason: str = ""
    deleting: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)


class InstanceIndex(Mapping[str, Entry]):
    """Entries by instance id (a read-only mapping; changes go through the methods)."""

    def __init__(self, ctx: FleetContext) -> None:
        self._ctx = ctx
        self._entries: dict[str, Entry] = {}
        self.inflight: set[tuple[str, str]] = set()  # (host, domain) being made or removed

    # ------------------------------------------------------------------ mapping

    def __getitem__(self, instance_id: str) -> Entry:
        return self._entries[instance_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    # ------------------------------------------------------------------ queries

    def entry(self, instance_id: str) -> Entry:
        try:
            return self._entries[instance_id]
        except KeyError:
            raise NotFound(f"no instance {instance_id!r}") from None

    def by_domain(self, host: str, name: str, uuid: str = "") -> Entry | None:
        for e in self._entries.values():
            if e.record.host == host and (e.record.domain == name or (uuid and e.uuid == uuid)):
                return e
        return None

    def on_host(self, host: str) -> list[Entry]:
        return [e for e in self._entries.values() if e.record.host == host]

    def busy(self, host: str, domain: str) -> bool:
        return (host, domain) in self.inflight

    @staticmethod
    def view(e: Entry) -> Instance:
        return Instance(record=e.record.model_copy(deep=True), state=e.state, state_reason=e.reason)

    @staticmethod
    def check_live(e: Entry) -> None:
        if e.deleting:
            raise NotFound(f"instance {e.record.instance_id} is being deleted")
        if e.state is InstanceState.LOST:
            raise InvalidRequest(f"instance {e.record.instance_id} is lost (its domain is gone)")

    # ------------------------------------------------------------------ changes

    def reserve(self, instance_id: str, same: Callable[[InstanceRecord], bool]) -> Entry | None:
        """Before claiming ``instance_id``: the existing entry for an idempotent repeat, None
        when the id is free; Conflict when it is taken by something else."""
        existing = self._entries.get(instance_id)
        if existing is not None:
            if not existing.deleting and same(existing.record):
                return existing
            raise Conflict(f"instance {instance_id!r} already exists")
        return None

    def add(self, e: Entry) -> None:
        self._entries[e.record.instance_id] = e

    def setdefault(self, e: Entry) -> Entry:
        return self._entries.setdefault(e.record.instance_id, e)

    def discard(self, e: Entry) -> None:
        """Forget ``e`` (if the id still names it)."""
        if self._entries.get(e.record.instance_id) is e:
            del self._entries[e.record.instance_id]

    def pop(self, instance_id: str) -> Entry | None:
        return self._entries.pop(instance_id, None)

    def rekey(self, e: Entry, record: InstanceRecord) -> None:
        """``e`` under its new record's id (a warm-pool hand-off, or its undo)."""
        old = e.record.instance_id
        self._entries[record.instance_id] = e
        if old != record.instance_id and self._entries.get(old) is e:
            del self._entries[old]
        e.record = record

    def set_state(self, e: Entry, state: InstanceState, reason: str = "") -> None:
        """Change an instance's state; an event only when the state really changes."""
        if e.state == state:
            e.reason = reason or e.reason
            return
        e.state = state
        e.reason = reason
        kind = (
            FleetEventKind.INSTANCE_LOST
            if state is InstanceState.LOST
            else FleetEventKind.INSTANCE_STATE_CHANGED
        )
        self._ctx.emit(
            kind,
            host=e.record.host,
            instance_id=e.record.instance_id,
            incarnation=e.record.incarnation,
            state=state,
            detail=reason,
        )

    def announce_created(self, e: Entry, detail: str = "") -> None:
        self._ctx.emit(
            FleetEventKind.INSTANCE_CREATED,
            host=e.record.host,
            instance_id=e.record.instance_id,
            incarnation=e.record.incarnation,
            state=e.state,
            detail=detail,
        )
