"""An `EgressService` over recording stand-ins for the server's services (unit tests of its
bookkeeping: no database, so no `serve`; `record`, tokens, policies and CAs)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from agentic_sandbox.broker.egress.service import EgressService
from agentic_sandbox.broker.services import Services


class Recorder:
    """Audit, events and metrics: what was recorded, published or provided."""

    def __init__(self) -> None:
        self.items: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def record(self, *args: Any, **kw: Any) -> None:
        self.items.append((args, kw))

    publish = record

    def provide_counter(self, *args: Any) -> None:
        pass

    provide = provide_counter


def egress_service(tmp: Path) -> tuple[EgressService, Recorder]:
    """The service, and the recorder of its audit rows."""
    hosts = tmp / "hosts"
    hosts.write_text("")
    audit = Recorder()
    svc = SimpleNamespace(
        settings=SimpleNamespace(egress_hosts_file=hosts, egress_upstream_ca_file=None),
        metrics=Recorder(),
        audit=audit,
        events=Recorder(),
    )
    return EgressService(cast(Services, svc)), audit
