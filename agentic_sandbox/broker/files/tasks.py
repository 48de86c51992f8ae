"""The files path as the task layer asks for it (`broker/tasks/files.py`'s `TaskFiles`): A2A
file parts into a task's working directory, its outbox back. Every call goes through
`FilesService` (streams, SHA-256, temporary name and rename, limits, audit) as the task's owner
with the actor `system:tasks`; a refusal is its `ProblemError` naming the path and reason.
(The task layer's protocol is matched by shape: files and tasks do not import each other.)
"""

from __future__ import annotations

from agentic_sandbox.broker.agentlink import FileInfo, FileMkdir, FileUpload
from agentic_sandbox.broker.files.service import FilesService, Target
from agentic_sandbox.broker.http.problems import ProblemError, not_ready

ACTOR = "system:tasks"
CHUNK = 1024 * 1024


class _Bytes:
    """Bytes in hand, read as an upload body in chunks (no copy: memoryview slices)."""

    def __init__(self, data: bytes) -> None:
        self._view = memoryview(data)
        self._at = 0

    async def readany(self) -> bytes:
        chunk = self._view[self._at : self._at + CHUNK]
        self._at += len(chunk)
        return bytes(chunk)


class TaskFilesAdapter:
    def __init__(self, service: FilesService) -> None:
        self.service = service

    def available(self, instance_id: str) -> bool:
        conn = self.service.registry.get(instance_id)
        return conn is not None and conn.ready and "file_upload" in conn.info.stream_kinds

    def session_dirs(self, instance_id: str) -> bool:
        conn = self.service.registry.get(instance_id)
        return conn is not None and conn.ready and conn.info.session_dirs

    def _target(self, instance_id: str, owner: str) -> Target:
        conn = self.service.registry.get(instance_id)
        if conn is None or not conn.ready:
            raise not_ready(f"the agent of instance {instance_id!r} is not connected")
        return Target(instance_id, owner, ACTOR, conn)

    async def mkdir(self, instance_id: str, owner: str, path: str, user: str) -> None:
        t = self._target(instance_id, owner)
        await self.service.mkdir(t, FileMkdir(path, parents=True, owner=user))

    async def put(self, instance_id: str, owner: str, path: str, data: bytes, user: str) -> None:
        t = self._target(instance_id, owner)
        spec = FileUpload(path, owner=user, parents=True, size=len(data))
        with self.service.slot(instance_id):
            await self.service.upload(t, spec, _Bytes(data), None)

    async def listing(self, instance_id: str, owner: str, path: str) -> list[FileInfo]:
        t = self._target(instance_id, owner)
        try:
            found = await self.service.list(t, path, False, None)
        except ProblemError as exc:
            if exc.status == 404:
                return []  # no outbox (a run adopted after a restart that never had one)
            raise
        return found.entries

    async def read(self, instance_id: str, owner: str, path: str, limit: int) -> bytes:
        t = self._target(instance_id, owner)
        out = bytearray()
        with self.service.slot(instance_id):
            stream, info = await self.service.open_download(t, path, False)
            if info.type != "file" or info.size > limit:
                stream.cancel("canceled", "not wanted")
                raise _changed(path, limit)
            async for chunk in self.service.chunks(t, stream, path):
                out += chunk
                if len(out) > limit:
                    stream.cancel("canceled", "larger than announced")
                    raise _changed(path, limit)
        return bytes(out)


def _changed(path: str, limit: int) -> ProblemError:
    return ProblemError(
        409, f"{path}: changed while read (no longer a file of at most {limit} bytes)"
    )
