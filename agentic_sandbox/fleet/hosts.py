"""Hosts: the fleet's hypervisors (each a `HostDriver`), their load, placement, base images.

`HostRegistry` is a read-only mapping of host name -> driver. It makes drivers with the
factory it is given (libvirt's by default, see `service.Fleet`), tells a newly connected host's
domains to reconciliation, and answers placement: reading every host's committed resources and
claiming one happen under one lock, so parallel creates spread.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import Awaitable, Callable, Iterator, Mapping

from .context import FleetContext
from .driver import ByteProgress, HostDriver, Volumes
from .errors import Conflict, FleetError, HostUnavailable, InvalidRequest, NotFound
from .index import InstanceIndex
from .models import FleetEventKind, HostInfo, HostSpec, InstanceState, validate_name
from .placement import HostLoad, PlacementRequest, choose_host
from .states import SavedStates

DriverFactory = Callable[[HostSpec], HostDriver]
Reconcile = Callable[[HostDriver], Awaitable[object]]


class HostRegistry(Mapping[str, HostDriver]):
    def __init__(
        self,
        ctx: FleetContext,
        index: InstanceIndex,
        states: SavedStates,
        *,
        make_driver: DriverFactory,
        reconcile: Reconcile,
    ) -> None:
        self._ctx = ctx
        self._index = index
        self._states = states
        self._make_driver = make_driver
        self._reconcile = reconcile
        self._hosts: dict[str, HostDriver] = {}
        self._draining: set[str] = set()
        self._image_locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._source_digests: dict[tuple[str, int, int], str] = {}
        self.placement_lock = asyncio.Lock()

    # ------------------------------------------------------------------ mapping

    def __getitem__(self, name: str) -> HostDriver:
        return self._hosts[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._hosts)

    def __len__(self) -> int:
        return len(self._hosts)

    def host(self, name: str) -> HostDriver:
        try:
            return self._hosts[name]
        except KeyError:
            raise NotFound(f"no host {name!r}") from None

    # ------------------------------------------------------------------ add / remove

    async def add_host(self, spec: HostSpec) -> HostInfo:
        """Connect a host. A host that cannot be reached now is kept (unreachable) and retried
        in the background. Adding the same spec again is a no-op."""
        existing = self._hosts.get(spec.name)
        if existing is not None:
            if existing.spec == spec:
                return await self.host_info(spec.name)
            raise Conflict(f"host {spec.name!r} exists with a different definition")
        h = self._make_driver(spec)
        self._hosts[spec.name] = h
        self._ctx.emit(FleetEventKind.HOST_ADDED, host=spec.name, detail=spec.uri)
        try:
            await h.connect()
        except HostUnavailable as e:
            self._ctx.emit(FleetEventKind.HOST_UNREACHABLE, host=spec.name, detail=str(e))
            for ent in self._index.on_host(spec.name):
                self._index.set_state(ent, InstanceState.UNKNOWN, f"host unreachable: {e}")
            h.start_reconnecting()
            return await self.host_info(spec.name)
        await self._reconcile(h)
        return await self.host_info(spec.name)

    async def remove_host(
        self, name: str, *, force: bool = False, forget_storage: bool = False
    ) -> None:
        """Forget a host. Refused while instances are on it unless ``force`` (their domains
        stay on the host untouched; the fleet stops tracking them). ``forget_storage`` also
        drops the fleet's stores there (files are kept)."""
        h = self._hosts.get(name)
        if h is None:
            return
        on_it = [e.record.instance_id for e in self._index.on_host(name)]
        if on_it and not force:
            raise Conflict(f"host {name} still has instances {on_it}")
        if forget_storage and h.reachable:
            with contextlib.suppress(FleetError):
                await h.volumes.forget()
        await h.close()
        for iid in on_it:
            self._index.pop(iid)
        self._states.forget_host(name)
        del self._hosts[name]
        self._draining.discard(name)
        self._ctx.emit(FleetEventKind.HOST_REMOVED, host=name)

    async def close(self) -> None:
        for h in list(self._hosts.values()):
            await h.close()

    # ------------------------------------------------------------------ facts and load

    async def list_hosts(self) -> list[HostInfo]:
        return [await self.host_info(n) for n in sorted(self._hosts)]

    async def host_info(self, name: str) -> HostInfo:
        h = self.host(name)
        mine = [e for e in self._index.on_host(name) if e.state is not InstanceState.LOST]
        free = 0
        if h.reachable:
            with contextlib.suppress(FleetError):
                free = await h.free_memory_mib()
        return HostInfo(
            spec=h.spec,
            reachable=h.reachable,
            reason=h.reason,
            accel=h.accel.accel if h.accel else None,
            accel_reason=h.accel.reason if h.accel else "",
            cpus=h.cpus,
            memory_mib=h.memory_mib,
            free_memory_mib=free,
            committed_vcpus=sum(e.record.vcpus for e in mine),
            committed_memory_mib=sum(e.record.memory_mib for e in mine),
            instances=len(mine),
            draining=name in self._draining,
        )

    def set_draining(self, name: str, draining: bool) -> bool:
        """Stop (or resume) placing new instances on ``name``; what runs there stays. True
        when that changed something."""
        self.host(name)
        if draining == (name in self._draining):
            return False
        if draining:
            self._draining.add(name)
        else:
            self._draining.discard(name)
        kind = FleetEventKind.HOST_DRAINING if draining else FleetEventKind.HOST_UNDRAINED
        self._ctx.emit(kind, host=name)
        return True

    async def _source_sha256(self, path: str) -> str:
        """The digest of a local image file, computed once per version of the file."""
        st = await asyncio.to_thread(os.stat, path)
        key = (path, st.st_size, st.st_mtime_ns)
        digest = self._source_digests.get(key)
        if digest is None:
            digest = await asyncio.to_thread(_file_sha256, path)
            if len(self._source_digests) > 256:
                self._source_digests.clear()
            self._source_digests[key] = digest
        return digest

    def _image_lock(self, host: str, name: str) -> asyncio.Lock:
        """One put of an image to a host at a time: parallel creates upload it once."""
        return self._image_locks.setdefault((host, name), asyncio.Lock())

    async def _has_image(self, vol: Volumes, name: str, dest: str, sha256: str) -> bool:
        """The host has ``name`` when it was verified with this digest. A base from before
        verification (no marker) is read back once: kept and marked when it matches."""
        if not await vol.exists(dest):
            return False
        marked = await vol.verified_digest("bases", name)
        if marked is not None:
            return marked == sha256
        if await vol.digest(dest) != sha256:
            return False
        await vol.mark_verified("bases", name, sha256)
        return True

    async def host_loads(self) -> list[HostLoad]:
        loads = []
        for name in sorted(self._hosts):
            info = await self.host_info(name)
            cap = info.spec.capacity
            groups: dict[str, int] = {}
            for e in self._index.on_host(name):
                if e.record.anti_affinity:
                    groups[e.record.anti_affinity] = groups.get(e.record.anti_affinity, 0) + 1
            loads.append(
                HostLoad(
                    name=name,
                    reachable=info.reachable,
                    labels=info.spec.labels,
                    vcpu_capacity=cap.vcpus or int(max(info.cpus, 1) * cap.vcpu_overcommit),
                    memory_capacity_mib=(cap.memory_mib or info.memory_mib)
                    - cap.reserved_memory_mib,
                    free_memory_mib=info.free_memory_mib - cap.reserved_memory_mib,
                    committed_vcpus=info.committed_vcpus,
                    committed_memory_mib=info.committed_memory_mib,
                    instances=info.instances,
                    groups=groups,
                    draining=info.draining,
                )
            )
        return loads

    async def place(self, req: PlacementRequest) -> HostDriver:
        """The host for ``req`` (call under `placement_lock`, and claim it before leaving)."""
        return self.host(choose_host(await self.host_loads(), req))

    # ------------------------------------------------------------------ images

    async def import_image(
        self, name: str, path: str, *, host: str | None = None, replace: bool = False
    ) -> dict[str, str]:
        """Put a local file (base image, kernel, initrd) into hosts' image stores under
        ``name`` (a copy on local hosts, an upload stream to remote ones). Returns the path on
        each host. An existing image is kept unless ``replace`` (never replace a base that
        overlays still use). Without ``host``: every reachable host (a host cut off takes no
        placements, so a create elsewhere does not wait on it; it gets the image when named)."""
        validate_name(name)
        if not os.path.isabs(path) or not await asyncio.to_thread(os.path.isfile, path):
            raise InvalidRequest(f"image file {path!r} does not exist")
        if host:
            targets = [host]
        else:
            targets = [n for n in sorted(self._hosts) if self._hosts[n].reachable]
            if self._hosts and not targets:
                raise HostUnavailable("no host is reachable to import into")
        sha256 = await self._source_sha256(path)
        out: dict[str, str] = {}
        for hn in targets:
            h = self.host(hn)
            if not h.reachable:
                raise HostUnavailable(f"host {hn} is unreachable: {h.reason}")
            vol = h.volumes
            dest = vol.path("bases", name)
            async with self._image_lock(hn, name):
                if not replace and await self._has_image(vol, name, dest, sha256):
                    out[hn] = dest
                    continue
                self._ctx.emit(FleetEventKind.IMAGE_UPLOADING, host=hn, detail=name)
                self._ctx.fault("uploading")
                out[hn] = await vol.put_verified(
                    "bases",
                    name,
                    path,
                    sha256,
                    mode=0o644,
                    progress=self._upload_progress(hn, name),
                )
                self._ctx.emit(FleetEventKind.IMAGE_VERIFIED, host=hn, detail=f"{name} {sha256}")
        if not out:
            raise NotFound("no hosts to import into")
        return out

    def _upload_progress(self, host: str, name: str) -> ByteProgress | None:
        """An upload's bytes for whoever observes the operation under way (a provision)."""
        report = self._ctx.detail_observer()
        if report is None:
            return None
        tell = report

        def progress(done: int, total: int) -> None:
            tell(
                "uploading",
                {"host": host, "image": name, "bytes_done": done, "bytes_total": total},
            )

        return progress


def _file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
