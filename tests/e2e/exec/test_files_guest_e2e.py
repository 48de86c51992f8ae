"""Files in the real `isolated` guest of the exec e2e (the same guest: `conftest.py`): a 100 MiB
file pushed through the agent link alone arrives whole (SHA-256 checked by the guest's agent,
owned by the guest's default user), is listed, and comes back byte for byte, while an
interactive session on the same link keeps echoing keystrokes; a directory goes and comes
back as a tar stream. The MB/s of each way and the keystroke echo times (idle, and during
each transfer) are printed (a TCG guest: read them with the load)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agentic_sandbox import Client
from tests.support.ptyclient import PtyClient
from tests.support.server import ServerProcess
from tests.support.sessions import create_session

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]
MiB = 1024 * 1024
SIZE = 100 * MiB
MAX_KEYS = 5000  # a bound on the keystrokes typed during one transfer


async def echo_time(ctl: PtyClient, key: str) -> float:
    """Type `key` and Enter; seconds until its echo is back (the guest's tty echoes it)."""
    t0 = time.perf_counter()
    await ctl.send_input(f"{key}\r".encode())
    await ctl.wait_output(key.encode(), timeout=120)
    return time.perf_counter() - t0


async def typing_during(
    ctl: PtyClient, name: str, work: Callable[[], Any]
) -> tuple[Any, list[float], int]:
    """Run `work` in a thread and type keystrokes until it ends: its result, the echo times
    of the keystrokes whose echo came back while it still ran, and how many were typed."""
    out: dict[str, Any] = {}

    def main() -> None:
        try:
            out["result"] = work()
        except BaseException as exc:  # handed to the test below
            out["error"] = exc

    thread = threading.Thread(target=main, name=name, daemon=True)
    thread.start()
    during: list[float] = []
    typed = 0
    while thread.is_alive() and typed < MAX_KEYS:
        took = await echo_time(ctl, f"{name}-{typed:05d}")  # every keystroke echoes
        typed += 1
        if thread.is_alive():
            during.append(took)
    await asyncio.to_thread(thread.join, 1200)
    assert not thread.is_alive(), f"the {name} did not end"
    if "error" in out:
        raise out["error"]
    return out["result"], during, typed


def ms(xs: list[float]) -> str:
    if not xs:
        return "none"
    q = sorted(xs)
    p95 = q[min(len(q) - 1, int(0.95 * len(q)))]
    return (
        f"n={len(q)} p50 {statistics.median(q) * 1000:.0f} ms, p95 {p95 * 1000:.0f} ms, "
        f"max {q[-1] * 1000:.0f} ms"
    )


async def test_push_list_and_pull_in_the_isolated_guest_while_a_session_types(
    server: ServerProcess, guest: str, tmp_path: Path
) -> None:
    inst = server.ok("GET", f"/api/v2/admin/instances/{guest}")
    assert inst["network_policy"] == "isolated"
    local = tmp_path / "payload.bin"
    digest = hashlib.sha256()
    with local.open("wb") as f:
        for _ in range(SIZE // MiB):
            block = os.urandom(MiB)
            digest.update(block)
            f.write(block)
    want = digest.hexdigest()
    remote = "/var/tmp/e2e-files/payload.bin"
    sid = create_session(server, guest, ["cat"])
    with Client(server.url, server.admin_token, timeout=600) as sbx:
        files = sbx.instances.files
        user = sbx.instances.exec(guest, ["id", "-un"]).stdout.data.strip()
        async with await PtyClient.connect(
            server.ws_url, sid, server.admin_token, role="control", from_offset=0
        ) as ctl:
            idle = [await echo_time(ctl, f"idle-{i}") for i in range(10)]

            t0 = time.monotonic()
            up, up_keys, up_typed = await typing_during(
                ctl, "upload", lambda: files.upload(guest, local, remote, parents=True)
            )
            up_s = time.monotonic() - t0
            assert up.sha256 == want and up.size == SIZE

            back = tmp_path / "back.bin"
            t0 = time.monotonic()
            got, down_keys, down_typed = await typing_during(
                ctl, "download", lambda: files.download(guest, remote, back)
            )
            down_s = time.monotonic() - t0
        server.api("POST", f"/api/v2/admin/sessions/{sid}/kill", {})
        print(
            f"\nguest files: upload {SIZE / up_s / 1e6:.1f} MB/s, download "
            f"{SIZE / down_s / 1e6:.1f} MB/s (100 MiB, TCG, load {os.getloadavg()})\n"
            f"keystroke echo: idle {ms(idle)}; during the upload {ms(up_keys)} "
            f"({up_typed} typed); during the download {ms(down_keys)} ({down_typed} typed)"
        )
        # the session kept answering while each transfer ran (not only after it)
        assert up_keys, "no keystroke echoed while the upload ran"
        assert down_keys, "no keystroke echoed while the download ran"

        check = sbx.instances.exec(guest, ["sha256sum", remote])
        assert check.stdout.data.split()[0] == want
        listing = files.list(guest, "/var/tmp/e2e-files")
        assert [(e.name, e.type, e.size) for e in listing.items] == [("payload.bin", "file", SIZE)]
        assert listing.items[0].owner == user and listing.items[0].mode == "0644"
        assert got.sha256 == want and got.size == SIZE
        back_digest = hashlib.sha256()
        with back.open("rb") as f:
            while block := f.read(MiB):
                back_digest.update(block)
        assert back_digest.hexdigest() == want

        tree = tmp_path / "tree"
        (tree / "sub").mkdir(parents=True)
        (tree / "sub" / "note.txt").write_text("through the tar stream\n")
        files.upload(guest, tree, "/var/tmp/e2e-files/tree")
        cat = sbx.instances.exec(guest, ["cat", "/var/tmp/e2e-files/tree/sub/note.txt"])
        assert cat.stdout.data == "through the tar stream\n"
        files.download(guest, "/var/tmp/e2e-files/tree", tmp_path / "tree-back")
        assert (tmp_path / "tree-back" / "sub" / "note.txt").read_text() == (
            "through the tar stream\n"
        )
        assert files.remove(guest, "/var/tmp/e2e-files", recursive=True).removed == 5
