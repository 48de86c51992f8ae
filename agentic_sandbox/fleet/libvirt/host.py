"""`LibvirtHost`: one hypervisor host behind libvirt — the fleet's `HostDriver` for every URI
(``qemu:///system``, remote ``qemu+tcp/tls/ssh://``, the ``test:///`` driver).

It keeps the connection (and re-makes it), the storage pools, the SSH forward ports and the
accelerator choice, and offers the driver protocol's domain operations (`LibvirtDomain`) and
files (`LibvirtVolumes`). Blocking libvirt calls go through `LibvirtHost.run`, which runs them
in the fleet's bounded thread pool and turns ``libvirtError`` into fleet errors. A close
callback (libvirtd restarted or the link dropped) makes the host unreachable and starts a
reconnect loop with exponential backoff; once reconnected, the listener reconciles.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar
from urllib.parse import urlparse

import libvirt

from ..context import CallObserver
from ..domain_config import CloneIdentity, DomainConfig
from ..driver import DefinitionFacts, DomainScan, HostListener
from ..errors import FleetError, HostUnavailable, InvalidRequest, LibvirtFailure, NotFound
from ..kvm_probe import AccelReport, ProbeMemory, probe_key, probe_kvm, probe_kvm_async
from ..models import Accel, FleetConfig, HostSpec
from ..ports import PortAllocator
from ..qemu_access import qemu_gid
from .domain import LibvirtDomain, remove_domain
from .domain_xml import build_domain_xml, domain_facts, parse_record, rewrite_for_clone
from .events import domain_event, domain_status
from .storage import HostStorage
from .volumes import LibvirtVolumes

log = logging.getLogger(__name__)
T = TypeVar("T")

_DEAD_CONNECTION = {
    libvirt.VIR_ERR_NO_CONNECT,
    libvirt.VIR_ERR_INVALID_CONN,
    libvirt.VIR_ERR_RPC,
}
_NOT_FOUND = {
    libvirt.VIR_ERR_NO_DOMAIN,
    libvirt.VIR_ERR_NO_DOMAIN_SNAPSHOT,
    libvirt.VIR_ERR_NO_STORAGE_VOL,
    libvirt.VIR_ERR_NO_STORAGE_POOL,
}
_probe_cache: dict[str, AccelReport] = {}  # this process's probes, by their key (JSON)
PROBE_MEMORY_FILE = "kvm-probe.json"  # in the host's data directory


def translate(err: libvirt.libvirtError, host: str) -> FleetError:
    code = err.get_error_code()
    msg = f"{host}: {err.get_error_message() or err}"
    if code in _NOT_FOUND:
        return NotFound(msg)
    if (
        code in _DEAD_CONNECTION
        or (code == libvirt.VIR_ERR_SYSTEM_ERROR and err.get_error_domain() == libvirt.VIR_FROM_RPC)
        or (code == libvirt.VIR_ERR_INTERNAL_ERROR and "socket is closed" in msg)
    ):
        return HostUnavailable(msg)
    if code in (
        libvirt.VIR_ERR_OPERATION_INVALID,
        libvirt.VIR_ERR_CONFIG_UNSUPPORTED,
        libvirt.VIR_ERR_XML_ERROR,
        libvirt.VIR_ERR_INVALID_ARG,
    ):
        return InvalidRequest(msg)
    return LibvirtFailure(msg)


class LibvirtHost:
    """A `HostDriver` over one libvirt connection."""

    def __init__(
        self,
        spec: HostSpec,
        config: FleetConfig,
        executor: Executor,
        *,
        listener: HostListener,
        on_call: CallObserver | None = None,
    ) -> None:
        self.on_call = on_call
        self.spec = spec
        self.name = spec.name
        self.config = config
        self.executor = executor
        self.conn: libvirt.virConnect | None = None
        self.storage: HostStorage | None = None
        self.reachable = False
        self.reason = "not connected yet"
        self.accel: AccelReport | None = None
        self.domain_type = "qemu"
        self.cpus = 0
        self.memory_mib = 0
        lo, hi = spec.ssh_port_range
        self.ports = PortAllocator(lo, hi, probe_local=self.files_local)
        self._listener = listener
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reconnect_task: asyncio.Task[None] | None = None
        self._closing = False
        self._cb_ids: list[int] = []
        self.connect_count = 0
        self._reprobe_key: dict[str, Any] | None = None
        self.reprobe_task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ facts

    @property
    def files_local(self) -> bool:
        if self.spec.files != "auto":
            return self.spec.files == "local"
        parsed = urlparse(self.spec.uri)
        return parsed.hostname in (None, "", "localhost", "127.0.0.1")

    @property
    def data_dir(self) -> str:
        return self.spec.data_dir or self.config.data_dir

    @property
    def virtual(self) -> bool:
        return self.domain_type == "test"

    @property
    def volumes(self) -> LibvirtVolumes:
        return LibvirtVolumes(self)

    # ------------------------------------------------------------------ calls

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking call in the executor; ``libvirtError`` becomes a fleet error."""
        if self.conn is None:
            raise HostUnavailable(f"host {self.name} is unreachable: {self.reason}")
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        ok = False
        try:
            result = await loop.run_in_executor(self.executor, functools.partial(fn, *args))
            ok = True
            return result
        except libvirt.libvirtError as e:
            raise translate(e, self.name) from e
        finally:
            if self.on_call is not None:
                self.on_call(getattr(fn, "__name__", "call"), time.perf_counter() - started, ok)

    def require(self) -> tuple[libvirt.virConnect, HostStorage]:
        if self.conn is None or self.storage is None:
            raise HostUnavailable(f"host {self.name} is unreachable: {self.reason}")
        return self.conn, self.storage

    # ------------------------------------------------------------------ capacity

    async def free_memory_mib(self) -> int:
        """Free host memory (the test driver reports none: all of it is free)."""
        conn, _ = self.require()

        def free_memory_mib() -> int:
            free = int(conn.getFreeMemory()) // (1 << 20)
            if free == 0 and self.domain_type == "test":
                free = self.memory_mib
            return free

        return await self.run(free_memory_mib)

    # ------------------------------------------------------------------ domains

    async def list_domains(self) -> list[DomainScan]:
        conn, _ = self.require()

        def scan_domains() -> list[DomainScan]:
            out = []
            for dom in conn.listAllDomains(0):
                try:
                    st, reason = dom.state()
                    out.append(
                        DomainScan(
                            dom.name(), dom.UUIDString(), domain_status(st, reason), dom.XMLDesc(0)
                        )
                    )
                except libvirt.libvirtError as e:  # vanished while listing
                    if e.get_error_code() != libvirt.VIR_ERR_NO_DOMAIN:
                        raise
            return out

        return await self.run(scan_domains)

    async def domain_exists(self, name: str) -> bool:
        conn, _ = self.require()

        def _domain_exists() -> bool:
            return _find(conn, name) is not None

        return await self.run(_domain_exists)

    async def lookup(self, name: str, uuid: str = "") -> LibvirtDomain:
        conn, _ = self.require()

        def find() -> libvirt.virDomain:
            dom = _find(conn, name, uuid)
            if dom is None:
                return conn.lookupByName(name)  # raises libvirt's own "no domain"
            return dom

        return LibvirtDomain(self, await self.run(find))

    async def remove_domain(self, name: str, uuid: str = "") -> bool:
        conn, _ = self.require()

        def go() -> bool:
            dom = _find(conn, name, uuid)
            if dom is None:
                return False
            remove_domain(dom)
            return True

        return await self.run(go)

    def render(self, cfg: DomainConfig) -> str:
        return build_domain_xml(cfg)

    def reidentify(self, definition: str, ident: CloneIdentity) -> str:
        return rewrite_for_clone(definition, ident)

    def describe(self, definition: str) -> DefinitionFacts:
        facts = domain_facts(definition)
        return DefinitionFacts(
            name=facts.name,
            uuid=facts.uuid,
            overlay=facts.overlay,
            vcpus=facts.vcpus,
            memory_mib=facts.memory_mib,
            record=parse_record(definition),
        )

    async def define(self, definition: str) -> LibvirtDomain:
        conn, _ = self.require()
        return LibvirtDomain(self, await self.run(conn.defineXML, definition))

    # ------------------------------------------------------------------ connect

    async def connect(self) -> None:
        self._loop = asyncio.get_running_loop()
        loop = self._loop
        await self._probe_network()
        try:
            conn = await loop.run_in_executor(self.executor, libvirt.open, self.spec.connection_uri)
        except libvirt.libvirtError as e:
            self.reason = str(e.get_error_message() or e)
            raise HostUnavailable(f"host {self.name}: cannot connect: {self.reason}") from e
        try:
            await loop.run_in_executor(self.executor, self._setup, conn)
        except BaseException as e:
            with contextlib.suppress(Exception):
                await loop.run_in_executor(self.executor, self._teardown, conn)
            if isinstance(e, libvirt.libvirtError):
                raise translate(e, self.name) from e
            raise
        self.conn = conn
        self.reachable = True
        self.reason = ""
        self.connect_count += 1
        if self._reprobe_key is not None and (
            self.reprobe_task is None or self.reprobe_task.done()
        ):
            self.reprobe_task = loop.create_task(self._reprobe(self._reprobe_key))
        self._reprobe_key = None

    def _setup(self, conn: libvirt.virConnect) -> None:
        """Blocking part of connecting: callbacks, keepalive, storage, accelerator."""
        conn.registerCloseCallback(self._close_cb, None)
        if conn.getType() != "TEST" and self.config.keepalive_interval_s:
            with contextlib.suppress(libvirt.libvirtError):
                conn.setKeepAlive(self.config.keepalive_interval_s, self.config.keepalive_count)
        self._cb_ids = [
            conn.domainEventRegisterAny(
                None, libvirt.VIR_DOMAIN_EVENT_ID_LIFECYCLE, self._lifecycle_cb, None
            )
        ]
        info = conn.getInfo()
        self.memory_mib, self.cpus = int(info[1]), int(info[2])
        storage = HostStorage(
            conn,
            self.data_dir,
            files_local=self.files_local,
            qemu_gid=qemu_gid(self.config.qemu_group),
        )
        storage.ensure_pools()
        self.storage = storage
        self._decide_accel(conn)

    def _decide_accel(self, conn: libvirt.virConnect) -> None:
        if conn.getType() == "TEST":
            self.domain_type = "test"
            self.accel = AccelReport(Accel.TCG, "libvirt test driver")
            return
        choice = self.spec.accel
        if choice == "tcg":
            self.accel = AccelReport(Accel.TCG, "configured")
        elif choice == "kvm":
            self.accel = AccelReport(Accel.KVM, "configured")
        elif self.files_local:
            self.accel = self._local_accel()
        else:
            caps = conn.getDomainCapabilities(None, "x86_64", None, "kvm", 0)
            ok = "<domain>kvm</domain>" in caps
            self.accel = AccelReport(
                Accel.KVM if ok else Accel.TCG,
                "remote host: libvirt reports kvm (not probed)" if ok else "remote host: no kvm",
            )
        self.domain_type = "kvm" if self.accel.accel is Accel.KVM else "qemu"
        if self.accel.accel is Accel.TCG:
            log.info("host %s: guests run under TCG (%s)", self.name, self.accel.reason)

    def _probe_memory(self) -> ProbeMemory:
        return ProbeMemory(os.path.join(self.data_dir, PROBE_MEMORY_FILE))

    def _local_accel(self) -> AccelReport:
        """Blocking: this process's probe, else the host's remembered answer (and a re-probe
        in the background once connected), else a probe now (remembered for next time)."""
        key = probe_key(self.config.kvm_probe_kernel)
        memo = json.dumps(key, sort_keys=True)
        if memo in _probe_cache:
            return _probe_cache[memo]
        memory = self._probe_memory()
        remembered = memory.recall(key)
        if remembered is not None:
            self._reprobe_key = key
            return remembered
        report = probe_kvm(self.config.kvm_probe_kernel, timeout=self.config.kvm_probe_timeout_s)
        _probe_cache[memo] = report
        try:
            memory.remember(key, report)
        except OSError as e:
            log.warning("host %s: cannot remember the KVM probe: %s", self.name, e)
        return report

    async def _reprobe(self, key: dict[str, Any]) -> None:
        """Probe again (the answer in use was remembered); take the new answer."""
        loop = asyncio.get_running_loop()
        report = await probe_kvm_async(  # (cancelled by close(): its QEMU ends with it)
            self.config.kvm_probe_kernel, boot_window=self.config.kvm_probe_timeout_s
        )
        _probe_cache[json.dumps(key, sort_keys=True)] = report
        try:
            await loop.run_in_executor(None, self._probe_memory().remember, key, report)
        except OSError as e:
            log.warning("host %s: cannot remember the KVM probe: %s", self.name, e)
        old = self.accel
        self.accel = report
        self.domain_type = "kvm" if report.accel is Accel.KVM else "qemu"
        if old is not None and old.accel is not report.accel:
            log.warning(
                "host %s: the KVM probe now says %s (%s), not %s as remembered; guests made "
                "from now on use %s",
                self.name,
                report.accel.value,
                report.reason,
                old.accel.value,
                report.accel.value,
            )

    def _teardown(self, conn: libvirt.virConnect) -> None:
        for cb in self._cb_ids:
            with contextlib.suppress(libvirt.libvirtError):
                conn.domainEventDeregisterAny(cb)
        self._cb_ids = []
        with contextlib.suppress(libvirt.libvirtError):
            conn.unregisterCloseCallback()
        with contextlib.suppress(libvirt.libvirtError):
            conn.close()

    # ------------------------------------------------------------------ callbacks

    def _threadsafe(self, fn: Callable[..., Any], *args: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(fn, *args)

    def _lifecycle_cb(
        self,
        conn: libvirt.virConnect,
        dom: libvirt.virDomain,
        event: int,
        detail: int,
        _opaque: object,
    ) -> None:
        self._threadsafe(self._dispatch, dom.name(), dom.UUIDString(), event, detail)

    def _dispatch(self, name: str, uuid: str, event: int, detail: int) -> None:
        self._listener.on_domain_event(self, domain_event(name, uuid, event, detail))

    def _close_cb(self, conn: libvirt.virConnect, reason: int, _opaque: object) -> None:
        self._threadsafe(self._handle_close, conn, reason)

    def _handle_close(self, conn: libvirt.virConnect, reason: int) -> None:
        if self._closing or conn is not self.conn:
            return
        why = {
            libvirt.VIR_CONNECT_CLOSE_REASON_EOF: "libvirtd closed the connection",
            libvirt.VIR_CONNECT_CLOSE_REASON_KEEPALIVE: "keepalive timed out",
            libvirt.VIR_CONNECT_CLOSE_REASON_ERROR: "connection error",
            libvirt.VIR_CONNECT_CLOSE_REASON_CLIENT: "closed by client",
        }.get(reason, f"closed ({reason})")
        self.mark_unreachable(why)

    def mark_unreachable(self, why: str) -> None:
        old = self.conn
        self.conn = None
        self.storage = None
        self.reachable = False
        self.reason = why
        if old is not None and self._loop is not None:
            self._loop.run_in_executor(self.executor, self._teardown, old)
        self._listener.on_disconnect(self, why)
        if not self._closing and (self._reconnect_task is None or self._reconnect_task.done()):
            self._reconnect_task = asyncio.get_running_loop().create_task(self._reconnect_loop())

    async def _reconnect_loop(self) -> None:
        delay = self.config.reconnect_initial_s
        while not self._closing:
            try:
                await self.connect()
            except FleetError as e:
                self.reason = str(e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.config.reconnect_max_s)
                continue
            try:
                await self._listener.on_reconnect(self)
            except Exception:
                log.exception("host %s: reconciliation after reconnect failed", self.name)
            return

    async def _probe_network(self) -> None:
        """A network host is first reached with a bounded TCP connect: `libvirt.open` has no
        connect timeout, and a host whose packets vanish would hold an executor thread for
        minutes on each attempt."""
        endpoint = network_endpoint(self.spec.uri)
        if endpoint is None:
            return
        why = await probe_endpoint(endpoint)
        if why:
            self.reason = why
            raise HostUnavailable(f"host {self.name}: cannot connect: {why}")

    def start_reconnecting(self) -> None:
        if self._reconnect_task is None or self._reconnect_task.done():
            self._reconnect_task = asyncio.get_running_loop().create_task(self._reconnect_loop())

    async def close(self) -> None:
        self._closing = True
        if self.reprobe_task is not None:
            self.reprobe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.reprobe_task
        if self._reconnect_task is not None:
            self._reconnect_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reconnect_task
        conn, self.conn, self.storage = self.conn, None, None
        self.reachable = False
        self.reason = "closed"
        if conn is not None:
            await asyncio.get_running_loop().run_in_executor(self.executor, self._teardown, conn)


NETWORK_PORTS = {"tcp": 16509, "tls": 16514, "ssh": 22, "libssh": 22, "libssh2": 22}
PROBE_TIMEOUT_S = 2.0


def network_endpoint(uri: str) -> tuple[str, int] | None:
    """Where a network URI's libvirt (or ssh) listens; None for a local transport."""
    parsed = urlparse(uri)
    transport = parsed.scheme.partition("+")[2]
    if transport not in NETWORK_PORTS or not parsed.hostname:
        return None
    try:
        port = parsed.port
    except ValueError:
        return None
    return parsed.hostname, port or NETWORK_PORTS[transport]


async def probe_endpoint(endpoint: tuple[str, int], within: float = PROBE_TIMEOUT_S) -> str:
    """ "" when a TCP connection to ``endpoint`` opens ``within`` seconds, else why not."""
    timeout = within
    try:
        async with asyncio.timeout(timeout):
            _reader, writer = await asyncio.open_connection(*endpoint)
    except TimeoutError:
        return f"no answer from {endpoint[0]}:{endpoint[1]} within {timeout:g}s"
    except OSError as e:
        return f"{endpoint[0]}:{endpoint[1]}: {os.strerror(e.errno) if e.errno else e}"
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return ""


def _find(conn: libvirt.virConnect, name: str, uuid: str = "") -> libvirt.virDomain | None:
    """Blocking: the domain by UUID (when given and known), else by name; None if neither."""
    for how, key in (("uuid", uuid), ("name", name)):
        if not key:
            continue
        try:
            return conn.lookupByUUIDString(key) if how == "uuid" else conn.lookupByName(key)
        except libvirt.libvirtError as err:
            if err.get_error_code() != libvirt.VIR_ERR_NO_DOMAIN:
                raise
    return None
