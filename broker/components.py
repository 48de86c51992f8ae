"""The list of server components beyond the foundation, in start order.

Each layer (agent link, session hub, fleet, provisioning, A2A) adds itself here; tests can pass
their own factory to `Server` instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from broker.app import Component
    from broker.services import Services


def build_components(svc: Services) -> list[Component]:
    return []
