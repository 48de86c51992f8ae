"""`NewInstance`: the steps every new instance takes — create, clone from a state, clone from
a snapshot — inside one `Transaction`, each registered with its undo as it is taken.

Entering indexes the entry and takes its lock; leaving releases it. When a step fails the
entry is marked ``deleting`` (events and reconciliation leave it alone) and every step taken is
undone newest first — domain, serial log, seed, overlay, port, the in-flight mark, the index
entry — so nothing of a failed instance is left, and the error names the stage that failed.
"""

from __future__ import annotations

from types import TracebackType

from .context import FleetContext
from .driver import Domain, HostDriver
from .index import Entry, InstanceIndex
from .transaction import Transaction


class NewInstance:
    def __init__(
        self, ctx: FleetContext, index: InstanceIndex, entry: Entry, what: str, *, stage: str
    ) -> None:
        self._ctx = ctx
        self._index = index
        self.entry = entry
        self.record = entry.record
        self.tx = Transaction(what, stage=stage, on_failure=self._failing)
        self._host: HostDriver | None = None

    def _failing(self) -> None:
        self.entry.deleting = True

    @property
    def host(self) -> HostDriver:
        assert self._host is not None, "claim a host first"
        return self._host

    def step(self, stage: str) -> None:
        """The next step begins: it is what an error names; observers and the test seam hear
        of it."""
        self.tx.stage = stage
        self._ctx.fault(stage)

    async def __aenter__(self) -> NewInstance:
        self._index.add(self.entry)
        await self.entry.lock.acquire()
        self.tx.on_undo("index", lambda: self._index.discard(self.entry))
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> bool:
        try:
            if ev is None and self._host is not None:
                self._index.inflight.discard((self._host.name, self.record.domain))
            return await self.tx.__aexit__(et, ev, tb)
        finally:
            self.entry.lock.release()

    # ------------------------------------------------------------------ steps

    def claim(self, host: HostDriver) -> None:
        """The instance is being made on ``host`` (events and reconciliation wait for it)."""
        self._host = host
        key = (host.name, self.record.domain)
        self._index.inflight.add(key)
        self.tx.on_undo("inflight", lambda: self._index.inflight.discard(key))

    def allocate_port(self) -> None:
        ports = self.host.ports
        port = self.record.ssh_port = ports.allocate()
        self.tx.on_undo("port", lambda: ports.release(port))

    def made_file(self, what: str, path: str | None) -> None:
        """A file of the instance that must go if a later step fails."""
        vol = self.host.volumes
        self.tx.on_undo(what, lambda: vol.delete(path) if path and self.host.reachable else None)

    async def seed_and_serial_log(self, seed: str | None) -> None:
        """Copy the seed ISO to the host (if any); name the serial log."""
        vol = self.host.volumes
        name = self.record.domain
        if seed:
            self.record.seed = await vol.put_file("instances", f"{name}.seed.iso", seed)
            self.made_file("seed", self.record.seed)
        self.record.serial_log = vol.path("instances", f"{name}.serial.log")
        self.made_file("serial", self.record.serial_log)

    async def define(self, definition: str, *, uuid: str = "") -> Domain:
        """Define the domain (``uuid``: the one the definition names, when known)."""
        host, name = self.host, self.record.domain
        dom = await host.define(definition)
        self.entry.uuid = uuid or await dom.uuid()
        self.tx.on_undo("domain", lambda: host.remove_domain(name))
        return dom
