"""`/api/v2/admin/instances/{id}/files?path=…`: `PUT` (upload), `GET` (download, `?list`,
`?stat`), `DELETE`; `POST …/files/mkdir`.

Roles and ownership as every other instance route: viewers read (download, list, stat) an
instance they may see; operators write (upload, mkdir, delete) an instance they own (or any,
as an admin); another owner's instance is a 404. Bodies are streamed both ways, never read
whole.
"""

from __future__ import annotations

import contextlib
import urllib.parse
from typing import Any

from aiohttp import web

from agentic_sandbox.broker.agentlink import FileMkdir, FileUpload
from agentic_sandbox.broker.auth.principal import Principal, Role
from agentic_sandbox.broker.files.models import (
    FileDelete,
    FileGet,
    FileInfoOut,
    FileListOut,
    FilePut,
    FileQuery,
    MkdirRequest,
    RemovedOut,
    UploadOut,
)
from agentic_sandbox.broker.files.service import FilesService, Target, info_out
from agentic_sandbox.broker.http.problems import ProblemError
from agentic_sandbox.broker.http.routing import ApiRoutes, Call, NoBody, NoQuery
from agentic_sandbox.broker.instances import instance_to_change, instance_to_see
from agentic_sandbox.broker.services import services

api = ApiRoutes()

FILES_KEY: web.AppKey[FilesService] = web.AppKey("files_service")
PATH = "/api/v2/admin/instances/{instance_id}/files"
TAR = "application/x-tar"
READ_ERRORS = {
    403: "permission denied in the guest",
    404: "no such instance, or no such path (code path-not-found)",
    409: "not a directory / is a directory",
    422: "a bad path, or a symlink on the way (not followed unless asked)",
    429: "too many transfers on the instance (SANDBOX_FILES_MAX_TRANSFERS_PER_INSTANCE)",
    501: "the agent does not transfer files",
    502: "the agent link was lost",
    503: "the instance's agent is not connected",
}
WRITE_ERRORS = {
    **READ_ERRORS,
    409: "is a directory, exists already, not empty",
    413: "the upload is over SANDBOX_FILES_MAX_UPLOAD_BYTES",
    422: "a bad path, owner, tar stream or SHA-256",
    507: "no space left in the guest",
}


async def _target(call: Call[Any, Any], who: Principal, *, change: bool) -> Target:
    db = services(call.request).db
    iid = call.match["instance_id"]
    row = await (instance_to_change(db, who, iid) if change else instance_to_see(db, who, iid))
    return call.app[FILES_KEY].target(
        instance_id=row.id, incarnation=row.incarnation, owner=row.owner, actor=who.actor
    )


@api.get(
    PATH,
    query=FileGet,
    role=Role.viewer,
    summary="Download a file (or a directory as a tar stream), or list / stat a path",
    tag="files",
    content_type="application/octet-stream",
    responses=READ_ERRORS,
)
async def get_file(call: Call[NoBody, FileGet]) -> web.StreamResponse | FileListOut | FileInfoOut:
    """`?path=/abs/path` downloads: a file as `application/octet-stream`, a directory as an
    `application/x-tar` stream (symlinks inside stored as symlinks, never followed); the
    headers `X-File-Type`, `X-File-Size`, `X-File-Mode`, `X-File-Owner`, `X-File-Group` say
    what it is. A download whose SHA-256 does not match the agent's is broken off, never
    ended cleanly. `&list` answers the directory's entries (JSON), `&stat` the path's
    `FileInfoOut`."""
    who = call.require_principal()
    q = call.query
    if q.list and q.stat:
        raise ProblemError(422, "query: give list or stat, not both", code="invalid-input")
    t = await _target(call, who, change=False)
    service = call.app[FILES_KEY]
    if q.stat:
        return info_out(await service.stat(t, q.path, q.follow_symlinks))
    if q.list:
        return await _listing(service, t, q.path, q.follow_symlinks, q.limit)
    with service.slot(t.instance_id), services(call.request).streams.open(who, "files") as lease:
        stream, info = await service.open_download(t, q.path, q.follow_symlinks)
        lease.on_revoke(lambda reason: stream.cancel("canceled", f"credential revoked: {reason}"))
        directory = info.type == "directory"
        name = (info.name if info.name != "/" else "root") + (".tar" if directory else "")
        resp = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": TAR if directory else "application/octet-stream",
                "Content-Disposition": "attachment; filename*=UTF-8''" + urllib.parse.quote(name),
                "Cache-Control": "no-store",
                "X-File-Type": info.type,
                "X-File-Size": str(info.size),
                "X-File-Mode": f"{info.mode & 0o7777:04o}",
                "X-File-Owner": urllib.parse.quote(info.owner[:64]),
                "X-File-Group": urllib.parse.quote(info.group[:64]),
            },
        )
        resp.enable_chunked_encoding()
        chunks = service.chunks(t, stream, q.path)
        try:
            await resp.prepare(call.request)
            async with contextlib.aclosing(chunks) as it:
                async for data in it:
                    await resp.write(data)
            await resp.write_eof()
        except (ConnectionError, RuntimeError, ProblemError):
            # after the headers a failure can only break the response off (a clean end
            # would pass a partial or corrupt download for a whole one)
            stream.cancel("canceled", "the download was broken off")
            if call.request.transport is not None:
                call.request.transport.close()
        return resp


async def _listing(
    service: FilesService, t: Target, path: str, follow: bool, limit: int | None
) -> FileListOut:
    listing = await service.list(t, path, follow, limit)
    return FileListOut(
        path=path, items=[info_out(e) for e in listing.entries], truncated=listing.truncated
    )


@api.get(
    PATH + "/list",
    query=FileQuery,
    response=FileListOut,
    role=Role.viewer,
    summary="List a directory (the same as GET …/files?path=…&list)",
    tag="files",
    responses=READ_ERRORS,
)
async def list_files(call: Call[NoBody, FileQuery]) -> FileListOut:
    """Entries sorted by name, symlinks as themselves (`link_target`); at most `limit`
    (10000), `truncated` past it."""
    who = call.require_principal()
    t = await _target(call, who, change=False)
    q = call.query
    return await _listing(call.app[FILES_KEY], t, q.path, q.follow_symlinks, q.limit)


@api.get(
    PATH + "/stat",
    query=FileQuery,
    response=FileInfoOut,
    role=Role.viewer,
    summary="Stat a path (the same as GET …/files?path=…&stat)",
    tag="files",
    responses=READ_ERRORS,
)
async def stat_file(call: Call[NoBody, FileQuery]) -> FileInfoOut:
    """A symlink is described as itself unless `follow_symlinks`."""
    who = call.require_principal()
    t = await _target(call, who, change=False)
    q = call.query
    return info_out(await call.app[FILES_KEY].stat(t, q.path, q.follow_symlinks))


@api.put(
    PATH,
    query=FilePut,
    response=UploadOut,
    status=201,
    role=Role.operator,
    summary="Upload a file (raw body), or a directory (a tar stream body)",
    tag="files",
    responses=WRITE_ERRORS,
)
async def put_file(call: Call[NoBody, FilePut]) -> UploadOut:
    """The body is streamed to the agent, which writes it to a temporary name beside
    `path`, checks its SHA-256 against the server's (and `sha256`, if given, is checked
    first), keeps the mode and owner (the replaced file's, unless `mode`/`owner`/`group` are
    given; else 0644 and the guest's default user), fsyncs and renames it into place: a
    cancelled or failed upload leaves nothing. `Content-Type: application/x-tar` (or
    `directory=true`) unpacks a tar stream as the new directory `path` (refused when it
    exists; member names are checked: no absolute names, `..`, hard links, devices or
    symlinks out of the tree)."""
    who = call.require_principal()
    q = call.query
    service = call.app[FILES_KEY]
    announced = call.request.content_length
    service.check_size(announced)
    t = await _target(call, who, change=True)
    spec = FileUpload(
        path=q.path,
        directory=q.directory or call.request.content_type == TAR,
        mode=int(q.mode, 8) if q.mode is not None else None,
        owner=q.owner or "",
        group=q.group or "",
        follow_symlinks=q.follow_symlinks,
        parents=q.parents,
        size=announced or 0,
    )
    with service.slot(t.instance_id):
        try:
            result = await service.upload(t, spec, call.request.content, q.sha256)
        except ProblemError as exc:
            exc.close = True  # the rest of the body was not read
            raise
    return UploadOut(
        path=result.path[:4096],
        size=result.size,
        sha256=result.sha256.hex(),
        directory=spec.directory,
        entries=result.entries if spec.directory else None,
    )


@api.delete(
    PATH,
    query=FileDelete,
    response=RemovedOut,
    role=Role.operator,
    summary="Remove a file, an empty directory, or (recursive) a directory tree",
    tag="files",
    responses=WRITE_ERRORS,
)
async def delete_file(call: Call[NoBody, FileDelete]) -> RemovedOut:
    """Symlinks are removed, never followed (also inside a recursive remove)."""
    who = call.require_principal()
    t = await _target(call, who, change=True)
    out = await call.app[FILES_KEY].remove(t, call.query.path, call.query.recursive)
    return RemovedOut(path=out.path[:4096], removed=out.removed)


@api.post(
    PATH + "/mkdir",
    body=MkdirRequest,
    response=FileInfoOut,
    status=201,
    role=Role.operator,
    summary="Make a directory (parents: the missing ones too)",
    tag="files",
    responses=WRITE_ERRORS,
)
async def make_dir(call: Call[MkdirRequest, NoQuery]) -> FileInfoOut:
    who = call.require_principal()
    b = call.body
    t = await _target(call, who, change=True)
    spec = FileMkdir(
        path=b.path,
        parents=b.parents,
        mode=int(b.mode, 8) if b.mode is not None else None,
        owner=b.owner or "",
        group=b.group or "",
    )
    return info_out(await call.app[FILES_KEY].mkdir(t, spec))
