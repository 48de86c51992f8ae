"""`LibvirtVolumes`: the driver protocol's `Volumes` — a host's `HostStorage` (blocking, libvirt
storage pools or local files) with each call run in the fleet's executor. It holds no state of
its own: every call uses the host's current connection, so a disconnected host answers
`HostUnavailable`."""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from functools import partial
from typing import TYPE_CHECKING

from ..driver import ByteProgress
from ..models import InstanceRecord
from .save_images import SaveHeader
from .storage import HostStorage

if TYPE_CHECKING:
    from ..driver import SavedImage
    from .host import LibvirtHost


class LibvirtVolumes:
    def __init__(self, host: LibvirtHost) -> None:
        self._host = host

    def _storage(self) -> HostStorage:
        return self._host.require()[1]

    def path(self, kind: str, name: str) -> str:
        return self._storage().path(kind, name)

    def holds(self, kind: str, path: str) -> bool:
        return self._storage().holds(kind, path)

    async def exists(self, path: str) -> bool:
        return await self._host.run(self._storage().exists, path)

    async def image_path(self, name: str) -> str:
        return await self._host.run(self._storage().image_path, name)

    async def create_overlay(self, kind: str, name: str, backing: str, capacity: int | None) -> str:
        return await self._host.run(self._storage().create_overlay, kind, name, backing, capacity)

    async def clone_snapshot_disk(self, src: str, snapshot: str, base: str, dest: str) -> None:
        await self._host.run(self._storage().clone_snapshot_disk, src, snapshot, base, dest)

    async def put_file(self, kind: str, name: str, source: str, *, mode: int = 0o600) -> str:
        storage = self._storage()
        if mode == 0o600:
            return await self._host.run(storage.put_file, kind, name, source)
        return await self._host.run(partial(storage.put_file, kind, name, source, mode=mode))

    async def verified_digest(self, kind: str, name: str) -> str | None:
        return await self._host.run(self._storage().verified_digest, kind, name)

    async def mark_verified(self, kind: str, name: str, sha256: str) -> None:
        await self._host.run(self._storage().mark_verified, kind, name, sha256)

    async def digest(self, path: str) -> str:
        return await self._host.run(self._storage().digest, path)

    async def put_verified(
        self,
        kind: str,
        name: str,
        source: str,
        sha256: str,
        *,
        mode: int = 0o600,
        progress: ByteProgress | None = None,
    ) -> str:
        storage = self._storage()
        on_loop: ByteProgress | None = None
        if progress is not None:
            loop = asyncio.get_running_loop()
            tell = progress

            def on_loop(done: int, total: int) -> None:  # from the executor thread
                loop.call_soon_threadsafe(tell, done, total)

        return await self._host.run(
            partial(storage.put_verified, kind, name, source, sha256, mode=mode, progress=on_loop)
        )

    async def copy(self, src: str, kind: str, name: str) -> str:
        return await self._host.run(self._storage().copy, src, kind, name)

    async def read_range(self, path: str, offset: int, length: int | None) -> bytes:
        return await self._host.run(self._storage().read_range, path, offset, length)

    async def delete(self, path: str | None) -> bool:
        return await self._host.run(self._storage().delete, path)

    async def list_names(self, kind: str) -> list[str]:
        return await self._host.run(self._storage().list_names, kind)

    async def remove_instance_files(self, record: InstanceRecord) -> list[str]:
        return await self._host.run(self._storage().remove_instance_files, record)

    async def sweep_orphans(self, keep: Collection[str], busy_states: Collection[str]) -> list[str]:
        return await self._host.run(self._storage().sweep_orphans, keep, busy_states)

    async def collect_frozen_disks(self, busy_states: Collection[str]) -> list[str]:
        return await self._host.run(self._storage().collect_frozen_disks, busy_states)

    async def read_saved(self, path: str) -> SaveHeader:
        return await self._host.run(self._storage().read_saved, path)

    async def write_saved(self, path: str, image: SavedImage, definition: str) -> None:
        assert isinstance(image, SaveHeader), "a save image read by this driver"
        await self._host.run(self._storage().write_saved, path, image, definition)

    async def forget(self) -> None:
        await self._host.run(self._storage().forget_pools)
