"""A2A file parts: names and sizes checked at the boundary, files placed before the run and the
outbox read back after it (through a recording `TaskFiles`; the real path is the integration
test's)."""

from __future__ import annotations

import base64

import pytest

from agentic_sandbox.broker.agentlink import FileInfo
from agentic_sandbox.broker.tasks import Caller, InvalidTaskInput, TaskState
from agentic_sandbox.broker.tasks.errors import UnsupportedContent
from agentic_sandbox.broker.tasks.files import check_name, file_part
from tests.unit.a2a.conftest import Env


@pytest.mark.parametrize(
    "name", ["", "/etc/passwd", "../x", "a/../b", "a//b", "./a", "outbox/x", "a\x00b", "x" * 256]
)
def test_bad_names_are_refused_naming_the_field(name: str) -> None:
    with pytest.raises(InvalidTaskInput) as info:
        check_name(name, "message.parts[1].filename")
    assert info.value.field == "message.parts[1].filename"


def test_good_names_sizes_and_url_parts() -> None:
    assert check_name("src/main.c", "f") == "src/main.c"
    got = file_part({"raw": base64.b64encode(b"abc").decode(), "filename": "a.txt"}, 2, 10)
    assert (got.name, got.data) == ("a.txt", b"abc")
    assert file_part({"raw": "YWJj"}, 3, 10).name == "file-3"
    with pytest.raises(InvalidTaskInput, match="SANDBOX_TASK_FILE_MAX_BYTES") as info:
        file_part({"raw": base64.b64encode(b"x" * 11).decode()}, 1, 10)
    assert info.value.field == "message.parts[1].raw"
    with pytest.raises(UnsupportedContent, match="egress") as unsupported:
        file_part({"url": "https://example.com/f"}, 1, 10)
    assert unsupported.value.field == "message.parts[1].url"


class RecordingFiles:
    def __init__(self, session_dirs: bool = False) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.outbox: dict[str, bytes] = {}
        self.makes_session_dirs = session_dirs

    def available(self, instance_id: str) -> bool:
        return True

    def session_dirs(self, instance_id: str) -> bool:
        return self.makes_session_dirs

    async def mkdir(self, instance_id: str, owner: str, path: str, user: str) -> None:
        self.calls.append(("mkdir", path, user))

    async def put(self, instance_id: str, owner: str, path: str, data: bytes, user: str) -> None:
        self.calls.append(("put", path, data.decode()))

    async def listing(self, instance_id: str, owner: str, path: str) -> list[FileInfo]:
        self.calls.append(("list", path))
        return [
            FileInfo(f"{path}/{n}", n, "file", len(d), 0o644, 0, 0, "", "", 0, "")
            for n, d in self.outbox.items()
        ] + [FileInfo(f"{path}/dir", "dir", "directory", 0, 0o755, 0, 0, "", "", 0, "")]

    async def read(self, instance_id: str, owner: str, path: str, limit: int) -> bytes:
        self.calls.append(("read", path))
        return self.outbox[path.rsplit("/", 1)[1]]


async def test_files_go_in_before_the_run_and_the_outbox_comes_back(env: Env) -> None:
    files = RecordingFiles()
    env.tasks.use_files(files)
    await env.add_instance()
    raw = base64.b64encode(b"hi").decode()
    rec = await env.submit(parts=[{"text": "cat in.txt"}, {"raw": raw, "filename": "in.txt"}])
    (sess,) = await env.fake.wait_session()
    work = f"/tmp/a2a-tasks/{rec.id}"
    assert files.calls == [("mkdir", f"{work}/outbox", ""), ("put", f"{work}/in.txt", "hi")]
    assert sess.spec.cwd == work
    assert sess.spec.env["A2A_OUTBOX"] == f"{work}/outbox"
    files.outbox = {"small.txt": b"ok", "big.bin": b"x" * (300 * 1024)}
    env.fake.exit(sess.id, 0)
    done = await env.until(rec.id, TaskState.completed)
    arts = {a["artifactId"]: a for a in done.to_a2a()["artifacts"]}
    assert arts["outbox/small.txt"]["parts"][0]["raw"] == base64.b64encode(b"ok").decode()
    url = arts["outbox/big.bin"]["parts"][0]["url"]
    assert url.endswith(f"/api/v2/admin/instances/vm1/files?path={work}/outbox/big.bin")
    assert "outbox/dir" not in arts
    stored = await env.tasks.get(rec.id, Caller("x", "x", is_admin=True))
    assert {a["artifactId"] for a in stored.to_a2a()["artifacts"]} == set(arts)


@pytest.mark.parametrize("agent_makes_dirs", [True, False])
async def test_an_agent_that_makes_session_dirs_gets_the_outbox_with_the_open(
    env: Env, agent_makes_dirs: bool
) -> None:
    """No file part: an agent that makes a session's directories gets the outbox in the
    open (no mkdir of its own); an older one gets the mkdir first, as before. With file parts
    the mkdir and the puts come first either way."""
    files = RecordingFiles(session_dirs=agent_makes_dirs)
    env.tasks.use_files(files)
    await env.add_instance()
    rec = await env.submit(parts=[{"text": "true"}])
    (sess,) = await env.fake.wait_session()
    outbox = f"/tmp/a2a-tasks/{rec.id}/outbox"
    if agent_makes_dirs:
        assert (files.calls, sess.spec.make_dirs) == ([], (outbox,))
    else:
        assert (files.calls, sess.spec.make_dirs) == ([("mkdir", outbox, "")], ())
    assert sess.spec.cwd == f"/tmp/a2a-tasks/{rec.id}"
    files.outbox = {"r.txt": b"ok"}
    env.fake.exit(sess.id, 0)
    done = await env.until(rec.id, TaskState.completed)
    assert "outbox/r.txt" in {a["artifactId"] for a in done.to_a2a()["artifacts"]}
    raw = base64.b64encode(b"hi").decode()
    rec2 = await env.submit(parts=[{"text": "true"}, {"raw": raw, "filename": "in.txt"}])
    (_, sess2) = await env.fake.wait_session(2)
    assert sess2.spec.make_dirs == ()
    assert files.calls[-2:] == [
        ("mkdir", f"/tmp/a2a-tasks/{rec2.id}/outbox", ""),
        ("put", f"/tmp/a2a-tasks/{rec2.id}/in.txt", "hi"),
    ]


async def test_file_parts_without_a_files_path_reject_the_task(env: Env) -> None:
    await env.add_instance()
    rec = await env.submit(parts=[{"text": "true"}, {"raw": "aGk=", "filename": "a"}])
    assert rec.state is TaskState.rejected and "files not supported" in str(rec.status_message)


def _info(outbox: str, name: str, kind: str, size: int) -> FileInfo:
    return FileInfo(f"{outbox}/{name}", name, kind, size, 0o644, 0, 0, "", "", 0, "")


@pytest.mark.parametrize("listed", [True, False], ids=["listed-with-the-exit", "older-agent"])
async def test_the_outbox_listing_comes_with_the_exit(env: Env, listed: bool) -> None:
    """The run's session asks the agent to list the outbox on exit: with that listing the
    server opens no listing stream (only the small files' reads); an exit without one (an
    older agent, a listing the agent could not make) is listed by a stream, as before.
    Entries an agent should not send (a name with a slash, `..`) are skipped either way."""
    files = RecordingFiles(session_dirs=True)
    env.tasks.use_files(files)
    await env.add_instance()
    rec = await env.submit(parts=[{"text": "true"}])
    (sess,) = await env.fake.wait_session()
    outbox = f"/tmp/a2a-tasks/{rec.id}/outbox"
    assert sess.spec.list_on_exit == outbox
    files.outbox = {"r.txt": b"ok"}
    listing = (
        (
            _info(outbox, "r.txt", "file", 2),
            _info(outbox, "sub", "directory", 0),
            _info(outbox, "../escape", "file", 2),
            _info(outbox, "..", "file", 2),
        )
        if listed
        else None
    )
    env.fake.exit(sess.id, 0, listing=listing)
    done = await env.until(rec.id, TaskState.completed)
    assert {a["artifactId"] for a in done.to_a2a()["artifacts"]} >= {"outbox/r.txt"}
    assert "outbox/sub" not in {a["artifactId"] for a in done.to_a2a()["artifacts"]}
    read = ("read", f"{outbox}/r.txt")
    assert files.calls == ([read] if listed else [("list", outbox), read])
