"""Files against a real server and a real host agent (as root): round trips with SHA-256 (a
file, a directory as a tar stream, mode and owner kept), a big transfer with flat memory in
the server and the agent, a cancelled upload and a full disk leave nothing, bad paths,
symlinks and tar members refused by name, the limits (413/429) and roles."""

from __future__ import annotations

import hashlib
import os
import pwd
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentic_sandbox import AsyncClient, Client
from agentic_sandbox.sdk import ApiError
from tests.support.agents import AgentProcess
from tests.support.fixtures import AgentFactory, ServerFactory, unique_id
from tests.support.server import ServerProcess

pytestmark = pytest.mark.timeout(300)
MiB = 1024 * 1024


def files_url(server: ServerProcess, iid: str, **params: str) -> str:
    return f"{server.url}/api/v2/admin/instances/{iid}/files?" + urllib.parse.urlencode(params)


def call(
    server: ServerProcess,
    method: str,
    iid: str,
    params: dict[str, str],
    data: bytes | None = None,
    *,
    token: str | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes, Any]:
    req = urllib.request.Request(
        files_url(server, iid, **params),
        data=data,
        method=method,
        headers={"Authorization": f"Bearer {token or server.admin_token}", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read(), resp.headers
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers


def problem(raw: bytes) -> dict[str, Any]:
    import json

    doc = json.loads(raw)
    assert isinstance(doc, dict)
    return doc


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".part"))


def wait_until(check: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"still not true after {timeout}s: {what}")
        time.sleep(0.05)


@pytest.fixture
async def sbx(sandbox_server: ServerProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(sandbox_server.url, sandbox_server.admin_token) as client:
        yield client


async def test_a_file_round_trip_keeps_bytes_sha256_mode_and_owner(
    sandbox_server: ServerProcess, agent: AgentProcess, sbx: AsyncClient, tmp_path: Path
) -> None:
    iid = agent.instance_id
    local = tmp_path / "source.bin"
    local.write_bytes(os.urandom(5 * MiB + 123))
    remote = tmp_path / "remote" / "copy.bin"
    seen: list[tuple[int, int | None]] = []
    up = await sbx.instances.files.upload(
        iid,
        local,
        str(remote),
        mode=0o640,
        owner="nobody",
        parents=True,
        progress=lambda d, t: seen.append((d, t)),
    )
    digest = hashlib.sha256(local.read_bytes()).hexdigest()
    assert up.sha256 == digest and up.size == local.stat().st_size and not up.directory
    assert seen[-1] == (up.size, up.size)
    st = remote.stat()
    assert st.st_mode & 0o777 == 0o640 and st.st_uid == pwd.getpwnam("nobody").pw_uid
    info = await sbx.instances.files.stat(iid, str(remote))
    assert (info.type, info.size, info.mode, info.owner) == ("file", up.size, "0640", "nobody")

    # replacing it without a mode or owner keeps the replaced file's
    await sbx.instances.files.upload(iid, b"new content\n", str(remote))
    st = remote.stat()
    assert remote.read_bytes() == b"new content\n"
    assert st.st_mode & 0o777 == 0o640 and st.st_uid == pwd.getpwnam("nobody").pw_uid

    back = tmp_path / "back.bin"
    await sbx.instances.files.upload(iid, local, str(remote))
    got = await sbx.instances.files.download(iid, str(remote), back)
    assert got.sha256 == digest and back.read_bytes() == local.read_bytes()
    assert leftovers(remote.parent) == [] and leftovers(tmp_path) == []

    listing = await sbx.instances.files.list(iid, str(remote.parent))
    assert [(e.name, e.type) for e in listing.items] == [("copy.bin", "file")]
    with Client(sandbox_server.url, sandbox_server.admin_token) as sync:
        assert sync.instances.files.stat(iid, str(remote)).size == local.stat().st_size
        assert b"".join(sync.instances.files.chunks(iid, str(remote))) == local.read_bytes()
        made = sync.instances.files.mkdir(iid, str(tmp_path / "made" / "deep"), parents=True)
        assert made.type == "directory"
        assert sync.instances.files.remove(iid, str(tmp_path / "made"), recursive=True).removed == 2
    assert not (tmp_path / "made").exists()


async def test_a_directory_round_trips_as_a_tar_stream(
    agent: AgentProcess, sbx: AsyncClient, tmp_path: Path
) -> None:
    iid = agent.instance_id
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "a.txt").write_text("alpha")
    (tree / "sub" / "b.bin").write_bytes(os.urandom(300_000))
    (tree / "sub" / "b.bin").chmod(0o600)
    (tree / "sub" / "link").symlink_to("../a.txt")
    remote = tmp_path / "uploaded-tree"
    up = await sbx.instances.files.upload(iid, tree, str(remote))
    assert up.directory and up.entries == 5
    assert (remote / "a.txt").read_text() == "alpha"
    assert (remote / "sub" / "b.bin").read_bytes() == (tree / "sub" / "b.bin").read_bytes()
    assert (remote / "sub" / "b.bin").stat().st_mode & 0o777 == 0o600
    assert os.readlink(remote / "sub" / "link") == "../a.txt"
    back = tmp_path / "pulled-tree"
    got = await sbx.instances.files.download(iid, str(remote), back)
    assert got.type == "directory"
    assert (back / "sub" / "b.bin").read_bytes() == (tree / "sub" / "b.bin").read_bytes()
    assert os.readlink(back / "sub" / "link") == "../a.txt"
    with pytest.raises(ApiError) as exists:
        await sbx.instances.files.upload(iid, tree, str(remote))
    assert exists.value.status == 409 and exists.value.code == "path-exists"


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def peaks(sandbox_server: ServerProcess, agent: AgentProcess) -> Iterator[dict[str, int]]:
    """The peak RSS of the server and the agent while the test runs (sampled)."""
    assert agent.proc is not None
    pids = {"server": sandbox_server.pid, "agent": agent.worker_pid()}
    out = {name: rss(pid) for name, pid in pids.items()}
    out.update({f"base_{name}": value for name, value in list(out.items())})
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.02):
            for name, pid in pids.items():
                out[name] = max(out[name], rss(pid))

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    yield out  # the same dict the sampler updates: read it after the transfer
    stop.set()
    t.join()


async def test_a_big_file_streams_with_flat_memory(
    agent: AgentProcess, sbx: AsyncClient, tmp_path: Path, peaks: dict[str, int]
) -> None:
    size = 512 * MiB
    local = tmp_path / "big.bin"
    digest = hashlib.sha256()
    with local.open("wb") as f:
        block = os.urandom(MiB)
        for i in range(size // MiB):
            chunk = block[i % 7 :] + block[: i % 7]  # each MiB different
            digest.update(chunk)
            f.write(chunk)
    remote = tmp_path / "big-remote.bin"
    up = await sbx.instances.files.upload(agent.instance_id, local, str(remote))
    assert up.sha256 == digest.hexdigest() and remote.stat().st_size == size
    local.unlink()
    got = await sbx.instances.files.download(agent.instance_id, str(remote), tmp_path / "big-back")
    assert got.sha256 == digest.hexdigest() and got.size == size
    assert peaks["server"] > 0 and peaks["agent"] > 0
    for who in ("server", "agent"):
        grew = peaks[who] - peaks[f"base_{who}"]
        print(f"{who}: RSS {peaks[f'base_{who}'] >> 20} -> peak {peaks[who] >> 20} MiB")
        assert grew < 64 * MiB, f"the {who}'s RSS grew by {grew >> 20} MiB for a 512 MiB transfer"


def test_a_cancelled_upload_leaves_nothing(
    sandbox_server: ServerProcess, agent: AgentProcess, tmp_path: Path
) -> None:
    """A client that sends part of the body and goes away: the agent's temporary file goes,
    the destination never appears."""
    dest = tmp_path / "never.bin"
    path = f"/api/v2/admin/instances/{agent.instance_id}/files?" + urllib.parse.urlencode(
        {"path": str(dest)}
    )
    sock = socket.create_connection(("127.0.0.1", int(sandbox_server.url.rsplit(":", 1)[1])))
    sock.sendall(
        (
            f"PUT {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {sandbox_server.admin_token}\r\n"
            f"Content-Length: {64 * MiB}\r\n\r\n"
        ).encode()
    )
    sock.sendall(os.urandom(4 * MiB))
    wait_until(lambda: leftovers(tmp_path) != [], "the temporary file is being written")
    sock.close()
    wait_until(lambda: leftovers(tmp_path) == [], "the temporary file removed")
    assert not dest.exists()


def test_a_full_disk_is_507_and_leaves_nothing(
    sandbox_server: ServerProcess, agent: AgentProcess, tmp_path: Path
) -> None:
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    try:
        status, raw, _ = call(
            sandbox_server,
            "PUT",
            agent.instance_id,
            {"path": str(small / "f")},
            os.urandom(3 * MiB),
        )
        doc = problem(raw)
        assert status == 507 and doc["code"] == "no-space" and doc["reason"] == "no-space"
        assert str(small / "f") in doc["detail"]
        assert list(small.iterdir()) == []
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_bad_paths_symlinks_and_tar_members_are_refused_by_name(
    sandbox_server: ServerProcess, agent: AgentProcess, tmp_path: Path
) -> None:
    import io
    import tarfile

    iid = agent.instance_id
    outside = tmp_path / "outside"
    outside.mkdir()
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "out").symlink_to(outside)
    (tree / "file").write_text("x")

    status, raw, _ = call(sandbox_server, "PUT", iid, {"path": f"{tree}/../escape"}, b"x")
    doc = problem(raw)
    assert status == 422 and doc["errors"][0]["field"] == "query.path" and "'..'" in doc["detail"]

    status, raw, _ = call(sandbox_server, "PUT", iid, {"path": str(tree / "out" / "x")}, b"x")
    doc = problem(raw)
    assert status == 422 and doc["code"] == "symlink-refused" and str(tree / "out") in doc["detail"]
    assert list(outside.iterdir()) == []
    status, raw, _ = call(sandbox_server, "GET", iid, {"path": str(tree / "out"), "list": ""})
    assert status == 422 and problem(raw)["code"] == "symlink-refused"

    status, raw, _ = call(sandbox_server, "GET", iid, {"path": str(tree / "nope")})
    doc = problem(raw)
    assert status == 404 and doc["code"] == "path-not-found" and doc["path"] == str(tree / "nope")
    status, raw, _ = call(sandbox_server, "GET", iid, {"path": str(tree / "file"), "list": ""})
    assert status == 409 and problem(raw)["code"] == "not-a-directory"
    status, raw, _ = call(sandbox_server, "PUT", iid, {"path": str(tree)}, b"x")
    assert status == 409 and problem(raw)["code"] == "is-a-directory"
    status, raw, _ = call(
        sandbox_server, "PUT", iid, {"path": str(tree / "o"), "owner": "nosuchuser"}, b"x"
    )
    assert status == 422 and problem(raw)["errors"][0]["field"] == "query.owner"
    status, raw, _ = call(
        sandbox_server, "PUT", iid, {"path": str(tree / "d"), "sha256": "0" * 64}, b"x"
    )
    assert status == 422 and problem(raw)["code"] == "digest-mismatch"
    assert not (tree / "d").exists()

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        ok = tarfile.TarInfo("fine.txt")
        ok.size = 2
        tar.addfile(ok, io.BytesIO(b"ok"))
        evil = tarfile.TarInfo("../evil.txt")
        evil.size = 4
        tar.addfile(evil, io.BytesIO(b"evil"))
    status, raw, _ = call(
        sandbox_server,
        "PUT",
        iid,
        {"path": str(tree / "unpacked")},
        buf.getvalue(),
        headers={"Content-Type": "application/x-tar"},
    )
    doc = problem(raw)
    assert status == 422 and doc["code"] == "bad-tar" and "../evil.txt" in doc["detail"]
    assert not (tree / "unpacked").exists() and not (tmp_path / "evil.txt").exists()
    assert leftovers(tree) == []


def test_limits_are_413_and_429_naming_them(
    server_factory: ServerFactory, agent_factory: AgentFactory, tmp_path: Path
) -> None:
    server = server_factory(
        SANDBOX_FILES_MAX_UPLOAD_BYTES=str(MiB), SANDBOX_FILES_MAX_TRANSFERS_PER_INSTANCE="1"
    )
    iid = agent_factory(server, unique_id("files-limits")).instance_id
    status, raw, _ = call(server, "PUT", iid, {"path": str(tmp_path / "big")}, os.urandom(2 * MiB))
    doc = problem(raw)
    assert status == 413 and doc["code"] == "upload-too-large"
    assert "SANDBOX_FILES_MAX_UPLOAD_BYTES" in doc["detail"]

    # without a length, the body is refused once it passes the limit; nothing is kept
    with Client(server.url, server.admin_token) as sync:

        def chunks() -> Iterator[bytes]:
            for _ in range(3):
                yield os.urandom(MiB)

        import io

        class Unsized(io.RawIOBase):
            def __init__(self) -> None:
                self.it = chunks()

            def readable(self) -> bool:
                return True

            def read(self, n: int = -1) -> bytes:
                return next(self.it, b"")

        with pytest.raises(ApiError) as over:
            sync.instances.files.upload(iid, Unsized(), str(tmp_path / "unsized"))  # type: ignore[arg-type]
        assert over.value.status == 413
        wait_until(lambda: leftovers(tmp_path) == [], "the partial upload removed")
        assert not (tmp_path / "unsized").exists()

        # one transfer at a time: a download held open makes the next one 429
        (tmp_path / "held").write_bytes(os.urandom(8 * MiB))
        req = urllib.request.Request(
            files_url(server, iid, path=str(tmp_path / "held")),
            headers={"Authorization": f"Bearer {server.admin_token}"},
        )
        with urllib.request.urlopen(req, timeout=60) as held:
            assert held.read(1024)  # started, not finished (the rest waits in flow control)
            status, raw, headers = call(server, "GET", iid, {"path": str(tmp_path / "held")})
            doc = problem(raw)
            assert status == 429 and doc["code"] == "too-many-transfers"
            assert "SANDBOX_FILES_MAX_TRANSFERS_PER_INSTANCE" in doc["detail"]
            assert headers["Retry-After"] == "5"
            # list and stat are not transfers
            assert call(server, "GET", iid, {"path": str(tmp_path), "stat": ""})[0] == 200


def test_viewers_read_operators_write_other_owners_see_nothing(
    sandbox_server: ServerProcess, agent: AgentProcess, tmp_path: Path
) -> None:
    iid = agent.instance_id
    (tmp_path / "r.txt").write_text("readable")
    owner = sandbox_server.ok("GET", f"/api/v2/admin/instances/{iid}")["owner"]
    viewer = sandbox_server.make_token(owner, "viewer")  # the owner, with the viewer role
    other = sandbox_server.make_token(unique_id("files-other"), "operator")
    status, raw, _ = call(
        sandbox_server, "GET", iid, {"path": str(tmp_path / "r.txt")}, token=viewer
    )
    assert (status, raw) == (200, b"readable")
    assert (
        call(sandbox_server, "GET", iid, {"path": str(tmp_path), "list": ""}, token=viewer)[0]
        == 200
    )
    status, raw, _ = call(
        sandbox_server, "PUT", iid, {"path": str(tmp_path / "w")}, b"x", token=viewer
    )
    assert status == 403 and problem(raw)["code"] == "forbidden-role"
    status, _, _ = call(
        sandbox_server, "DELETE", iid, {"path": str(tmp_path / "r.txt")}, token=viewer
    )
    assert status == 403
    for method, data in (("GET", None), ("PUT", b"x"), ("DELETE", None)):
        status, _, _ = call(
            sandbox_server, method, iid, {"path": str(tmp_path / "r.txt")}, data, token=other
        )
        assert status == 404, method
    assert (tmp_path / "r.txt").read_text() == "readable" and not (tmp_path / "w").exists()

    def audited() -> set[str]:
        page = sandbox_server.ok("GET", f"/api/v2/admin/audit?subject_id={iid}&limit=1000")
        return {e["action"] for e in page["items"]}

    wait_until(lambda: "instance.files.download" in audited(), f"audited ({audited()})")
