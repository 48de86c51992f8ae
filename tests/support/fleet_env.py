"""The fast tier's environment: a Fleet on libvirt test-driver hosts, with its events."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agentic_sandbox.fleet import Fleet, FleetEvent
from tests.support.libvirt_testdriver import Faults


@dataclass
class Env:
    fleet: Fleet
    events: list[FleetEvent]
    root: Path
    faults: Faults

    @property
    def data(self) -> Path:
        return self.root / "fleet"

    def instance_files(self) -> list[str]:
        return sorted(p.name for p in (self.data / "instances").iterdir())

    def domains(self, host: str = "h1") -> list[str]:
        conn = self.fleet.hosts[host].conn
        assert conn is not None
        return sorted(d.name() for d in conn.listAllDomains(0))

    def volumes(self, host: str = "h1") -> list[str]:
        st = self.fleet.hosts[host].storage
        assert st is not None
        return sorted(st.pool("instances").listVolumes())

    def kinds(self, instance_id: str | None = None) -> list[str]:
        return [
            e.kind.value for e in self.events if instance_id is None or e.instance_id == instance_id
        ]

    def states(self, instance_id: str) -> list[str]:
        return [
            e.state.value
            for e in self.events
            if e.instance_id == instance_id
            and e.kind.value == "instance.state_changed"
            and e.state is not None
        ]
