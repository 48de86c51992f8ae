"""Hosts: add/list/remove hypervisors, their load for placement, base images on them."""

from __future__ import annotations

import asyncio
import contextlib
import os
from functools import partial

from .connection import HostConnection
from .core import FleetBase
from .errors import Conflict, FleetError, HostUnavailable, InvalidRequest, NotFound
from .models import FleetEventKind, HostInfo, HostSpec, InstanceState, validate_name
from .placement import HostLoad


class HostOps(FleetBase):
    async def add_host(self, spec: HostSpec) -> HostInfo:
        """Connect a host. A host that cannot be reached now is kept (unreachable) and retried
        in the background. Adding the same spec again is a no-op."""
        existing = self.hosts.get(spec.name)
        if existing is not None:
            if existing.spec == spec:
                return await self.host_info(spec.name)
            raise Conflict(f"host {spec.name!r} exists with a different definition")
        h = HostConnection(
            spec,
            self.config,
            self.executor,
            on_lifecycle=self.on_lifecycle,  # type: ignore[attr-defined]
            on_disconnect=self.on_disconnect,  # type: ignore[attr-defined]
            on_reconnect=self.on_reconnect,  # type: ignore[attr-defined]
            on_call=self.on_call,
        )
        self.hosts[spec.name] = h
        self.emit(FleetEventKind.HOST_ADDED, host=spec.name, detail=spec.uri)
        try:
            await h.connect()
        except HostUnavailable as e:
            self.emit(FleetEventKind.HOST_UNREACHABLE, host=spec.name, detail=str(e))
            for ent in self.entries.values():
                if ent.record.host == spec.name:
                    self.set_state(ent, InstanceState.UNKNOWN, f"host unreachable: {e}")
            h.start_reconnecting()
            return await self.host_info(spec.name)
        await self.reconcile_host(h)
        return await self.host_info(spec.name)

    async def remove_host(
        self, name: str, *, force: bool = False, forget_storage: bool = False
    ) -> None:
        """Forget a host. Refused while instances are on it unless ``force`` (their domains
        stay in that libvirt untouched; the fleet stops tracking them). ``forget_storage``
        also undefines the fleet's storage pools there (files are kept)."""
        h = self.hosts.get(name)
        if h is None:
            return
        on_it = [e.record.instance_id for e in self.entries.values() if e.record.host == name]
        if on_it and not force:
            raise Conflict(f"host {name} still has instances {on_it}")
        if forget_storage and h.storage is not None:
            with contextlib.suppress(FleetError):
                await h.run(h.storage.forget_pools)
        await h.close()
        for iid in on_it:
            self.entries.pop(iid, None)
        for sid in [s for s, st in self.saved_states.items() if st.host == name]:
            self.saved_states.pop(sid, None)
        del self.hosts[name]
        self.emit(FleetEventKind.HOST_REMOVED, host=name)

    async def list_hosts(self) -> list[HostInfo]:
        return [await self.host_info(n) for n in sorted(self.hosts)]

    async def host_info(self, name: str) -> HostInfo:
        h = self.host(name)
        mine = [
            e
            for e in self.entries.values()
            if e.record.host == name and e.state is not InstanceState.LOST
        ]
        free = 0
        if h.conn is not None:
            with contextlib.suppress(FleetError):
                free = await h.run(h.free_memory_mib)
        return HostInfo(
            spec=h.spec,
            reachable=h.conn is not None,
            reason=h.reason,
            accel=h.accel.accel if h.accel else None,
            accel_reason=h.accel.reason if h.accel else "",
            cpus=h.cpus,
            memory_mib=h.memory_mib,
            free_memory_mib=free,
            committed_vcpus=sum(e.record.vcpus for e in mine),
            committed_memory_mib=sum(e.record.memory_mib for e in mine),
            instances=len(mine),
        )

    async def host_loads(self) -> list[HostLoad]:
        loads = []
        for name in sorted(self.hosts):
            info = await self.host_info(name)
            cap = info.spec.capacity
            groups: dict[str, int] = {}
            for e in self.entries.values():
                if e.record.host == name and e.record.anti_affinity:
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
                )
            )
        return loads

    async def import_image(
        self, name: str, path: str, *, host: str | None = None, replace: bool = False
    ) -> dict[str, str]:
        """Put a local file (base image, kernel, initrd) into hosts' image stores under
        ``name`` (a copy on local hosts, an upload stream to remote ones). Returns the path on
        each host. An existing image is kept unless ``replace`` (never replace a base that
        overlays still use)."""
        validate_name(name)
        if not os.path.isabs(path) or not await asyncio.to_thread(os.path.isfile, path):
            raise InvalidRequest(f"image file {path!r} does not exist")
        targets = [host] if host else sorted(self.hosts)
        out: dict[str, str] = {}
        for hn in targets:
            h = self.host(hn)
            _, storage = h.require()
            dest = storage.path("bases", name)
            if not replace and await h.run(storage.exists, dest):
                out[hn] = dest
                continue
            out[hn] = await h.run(partial(storage.put_file, "bases", name, path, mode=0o644))
        if not out:
            raise NotFound("no hosts to import into")
        return out
