"""The installed package, the way a new user meets it, on real libvirtd + QEMU (TCG):

* a wheel built from the tree, installed into a fresh virtualenv with its dependencies from the
  lock (`requirements/server.txt`, hash-checked); its three console scripts run from a directory
  outside the checkout; the dashboard and every file it loads are served;
* with every extra installed in the same environment (the test lock: a2a-sdk brings proto-plus,
  whose import name is `proto`), that `sandbox-server` provisions a real guest whose agent
  enrolls — through that environment's `sandboxctl`;
* deletes leave nothing: a memory snapshot of that guest, a clone restored from it, the clone's
  own memory snapshot and two clones of that, deleted in both orders (clones first, source
  first), leave the whole data directory as it was; deleting the first guest too leaves it as
  it was before the first create, but for the image imported to the host;
* an agent that dies at start (the installed agent's `main()` broken in a way no import check
  sees) fails the provision at once, with the traceback's last lines as the cause.

One server data directory for the module. What a test needs (the running server, the first
guest with its memory snapshot, the image) is a module fixture, so each test runs alone as
well as in the module, where they share the first guest (one cold boot for it, one for the
crash; everything else is restored from memory).
Instance ids start with `$SANDBOX_TEST_NAME_PREFIX` (default `e2e-`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.e2e import (
    NAME_PREFIX,
    REAL_SERVER_ENV,
    RECIPE,
    domains_named,
    domains_under,
    forget_pools,
    listing,
    provision,
    require_real_libvirt,
    wait_agent,
    wait_op,
)
from tests.support.server import ROOT, ServerProcess

pytestmark = pytest.mark.e2e

GUEST = f"{NAME_PREFIX}pkg"
CRASH = f"{NAME_PREFIX}pkg-crash"


@dataclass
class Installed:
    root: Path  # a scratch directory under /var/tmp (QEMU must traverse it)
    venv: Path
    cwd: Path  # where the console scripts run: outside the checkout
    server: ServerProcess
    listings: dict[str, set[str]] = field(default_factory=dict)

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def run(self, *argv: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess[str]:
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("SANDBOX_", "PYTHON"))}
        return subprocess.run(
            argv,
            cwd=self.cwd,
            env={**clean, **env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def ctl(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return self.run(
            self.bin("sandboxctl"),
            *args,
            timeout=timeout,
            SANDBOX_URL=self.server.url,
            SANDBOX_TOKEN=self.server.admin_token,
            XDG_CONFIG_HOME=str(self.root / "config"),
        )

    def pip_install(self, *args: str) -> None:
        res = self.run(self.bin("python"), "-m", "pip", "install", "-q", *args, timeout=1200)
        assert res.returncode == 0, res.stderr[-3000:]

    @property
    def data(self) -> Path:
        return self.server.data_dir

    def site_file(self, relative: str) -> Path:
        (found,) = self.venv.glob(f"lib/python3*/site-packages/agentic_sandbox/{relative}")
        return found


def build_wheel(dest: Path) -> Path:
    """`pip wheel --no-deps` of the tree, built from a copy so the checkout gains no
    build/ or egg-info."""
    src = dest / "src"
    src.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "agentic_sandbox",
        src / "agentic_sandbox",
        ignore=shutil.ignore_patterns("__pycache__", "node_modules", "*.pyc"),
    )
    argv = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    res = subprocess.run(
        [*argv, "--wheel-dir", str(dest / "dist"), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    (wheel,) = (dest / "dist").glob("agentic_sandbox-*.whl")
    return wheel


@pytest.fixture(scope="module")
def installed() -> Iterator[Installed]:
    require_real_libvirt()
    root = Path(tempfile.mkdtemp(prefix=f"sbx-{NAME_PREFIX}pkg-", dir="/var/tmp"))
    root.chmod(0o755)
    venv = root / "venv"
    cwd = root / "cwd"
    cwd.mkdir()
    data = root / "data"
    inst = Installed(
        root,
        venv,
        cwd,
        ServerProcess(
            data,
            env=dict(REAL_SERVER_ENV),
            argv=[str(venv / "bin" / "sandbox-server"), "serve"],
            cwd=cwd,
        ),
    )
    data.chmod(0o755)
    try:
        wheel = build_wheel(root / "build")
        res = subprocess.run(
            [sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True, timeout=300
        )
        assert res.returncode == 0, res.stderr
        inst.pip_install(
            "--require-hashes", "--no-deps", "-r", str(ROOT / "requirements/server.txt")
        )
        inst.pip_install("--no-deps", str(wheel))
        yield inst
    finally:
        if inst.server.alive():
            for iid in (GUEST, CRASH, *(f"{GUEST}-{x}" for x in ("b", "c1", "c2"))):
                inst.server.api("DELETE", f"/api/v2/admin/instances/{iid}")
        inst.server.stop()
        leftovers = domains_under(data)
        forget_pools(data)
        shutil.rmtree(root, ignore_errors=True)
        assert leftovers == [], f"domains left behind: {leftovers}"


@pytest.fixture(scope="module")
def started(installed: Installed) -> Installed:
    """The installed server running, and the data directory's listing before any guest."""
    installed.server.start().wait_ready()
    installed.listings["start"] = listing(installed.data)
    return installed


@pytest.fixture(scope="module")
def guest(started: Installed) -> Installed:
    """With every extra installed (the test lock) and the server restarted on them: the first
    guest, created by that environment's `sandboxctl`, with a memory snapshot `s0`; the
    listing with it (`listings["guest"]`)."""
    installed = started
    installed.server.stop()
    installed.pip_install(
        "--require-hashes", "--no-deps", "-r", str(ROOT / "requirements/test.txt")
    )
    installed.server.start().wait_ready()
    res = installed.ctl("instance", "create", GUEST, "--image", RECIPE, "--loadout", "minimal")
    assert res.returncode == 0, res.stdout + res.stderr
    status, snap = installed.server.api(
        "POST", f"/api/v2/admin/instances/{GUEST}/snapshots", {"name": "s0", "memory": True}
    )
    assert status == 201, snap
    wait_agent(installed.server, GUEST)
    installed.listings["guest"] = listing(installed.data)
    return installed


@pytest.fixture(scope="module")
def image(started: Installed) -> Installed:
    """The recipe's image in the server's cache (built, or reused)."""
    status, op = started.server.api("POST", "/api/v2/admin/images", {"recipe": RECIPE})
    assert status == 202, op
    op = wait_op(started.server, op, timeout=900)
    assert op["state"] == "succeeded", (op.get("error"), op.get("stages"))
    return started


def test_console_scripts_run_from_outside_the_checkout(installed: Installed) -> None:
    for script in ("sandboxctl", "agent-client", "sandbox-server"):
        res = installed.run(installed.bin(script), "--help")
        assert res.returncode == 0 and "usage" in res.stdout.lower(), (script, res.stderr)
    res = installed.run(
        installed.bin("sandbox-server"), "check-config", SANDBOX_DATA_DIR=str(installed.data)
    )
    assert res.returncode == 0 and json.loads(res.stdout)["data_dir"] == str(installed.data)
    res = installed.run(
        installed.bin("python"), "-c", "import agentic_sandbox; print(agentic_sandbox.__file__)"
    )
    assert str(installed.venv) in res.stdout, "the package came from the checkout, not the wheel"


def test_the_dashboard_and_every_file_it_loads_are_served(started: Installed) -> None:
    installed = started
    srv = installed.server
    with urllib.request.urlopen(srv.url + "/", timeout=30) as resp:
        assert resp.status == 200
        page = resp.read().decode()
    todo = [u for u in re.findall(r'(?:src|href)="(/[^"#]+)"', page)]
    assert "/vendor/xterm/lib/xterm.js" in todo, todo
    seen: set[str] = set()
    while todo:
        url = todo.pop()
        if url in seen:
            continue
        seen.add(url)
        with urllib.request.urlopen(srv.url + url, timeout=30) as resp:
            assert resp.status == 200, url
            body = resp.read()
        kind, _, rel = url.lstrip("/").partition("/")
        assert body == installed.site_file(f"broker/dashboard/{kind}/{rel}").read_bytes(), url
        if url.endswith(".js") and kind == "static":  # the page's modules import each other
            todo += re.findall(r'from "(/static/[\w./-]+\.js)"', body.decode())
    assert {"/vendor/xterm/css/xterm.css", "/vendor/xterm-addon-fit/lib/addon-fit.js"} <= seen
    assert len([u for u in seen if u.startswith("/static/")]) >= 5, seen


def test_with_every_extra_installed_the_console_script_provisions_a_guest_that_enrolls(
    guest: Installed,
) -> None:
    installed = guest
    res = installed.run(installed.bin("python"), "-c", "import proto; print(proto.__file__)")
    assert res.returncode == 0 and "site-packages/proto/" in res.stdout, (
        "the trap is not set: no proto-plus in the environment " + res.stdout + res.stderr
    )
    agent = installed.server.ok("GET", f"/api/v2/admin/agents/{GUEST}")
    assert agent["state"] == "connected", agent


def clone(srv: ServerProcess, source: str, snapshot: str, new: str) -> None:
    status, op = srv.api(
        "POST", f"/api/v2/admin/instances/{source}/clone", {"new_id": new, "snapshot": snapshot}
    )
    assert status == 202, op
    op = wait_op(srv, op, timeout=300)
    assert op["state"] == "succeeded", (op.get("error"), op.get("stages"))


def delete(srv: ServerProcess, instance: str) -> None:
    status, body = srv.api("DELETE", f"/api/v2/admin/instances/{instance}")
    assert status == 204, (instance, status, body)


@pytest.mark.parametrize("order", ["clones-first", "source-first"])
def test_deletes_leave_nothing(guest: Installed, order: str) -> None:
    """A clone B of the guest's memory snapshot, B's own memory snapshot, two clones of that;
    all three deleted: the data directory is, file for file, what it was before B."""
    installed = guest
    srv = installed.server
    before = installed.listings["guest"]
    source, clones = f"{GUEST}-b", [f"{GUEST}-c1", f"{GUEST}-c2"]
    clone(srv, GUEST, "s0", source)
    status, snap = srv.api(
        "POST", f"/api/v2/admin/instances/{source}/snapshots", {"name": "s1", "memory": True}
    )
    assert status == 201, snap
    wait_agent(srv, source)
    for new in clones:
        clone(srv, source, "s1", new)
    states = installed.data / "fleet" / "states"
    assert (states / f"{source}--s1.save").exists() and (states / f"{source}--s1.qcow2").exists()
    for instance in [*clones, source] if order == "clones-first" else [source, *clones]:
        delete(srv, instance)
    after = listing(installed.data)
    assert after == before, {"left": sorted(after - before), "gone": sorted(before - after)}


def test_deleting_the_first_guest_leaves_the_data_dir_as_it_started(guest: Installed) -> None:
    installed = guest
    delete(installed.server, GUEST)
    after = listing(installed.data)
    start = installed.listings["start"]
    added, gone = after - start, start - after
    assert gone == set(), sorted(gone)
    # only the image imported to the host stays (shared by every instance, by design)
    assert added and all(n.startswith("fleet/bases/") for n in added), sorted(added)


def test_an_agent_that_dies_at_start_fails_the_provision_at_once(image: Installed) -> None:
    """The installed agent's main() fails to import a module: the start-up import check cannot
    see it (it does not run main), the guest's agent crash-loops, and the provision fails as
    soon as the console shows the traceback — not at the 300 s enrolment timeout."""
    installed = image
    srv = installed.server
    srv.stop()
    main_py = installed.site_file("agent/main.py")
    text = main_py.read_text()
    broken = text.replace(
        "def main(argv: list[str] | None = None) -> int:\n",
        "def main(argv: list[str] | None = None) -> int:\n"
        "    from agentic_sandbox.agent import no_such_module  # noqa: F401\n",
        1,
    )
    assert broken != text
    main_py.write_text(broken)
    try:
        srv.start().wait_ready()
        crash_fails_at_once(installed)
    finally:  # later guests get the agent as installed
        srv.stop()
        main_py.write_text(text)
        srv.start().wait_ready()


def crash_fails_at_once(installed: Installed) -> None:
    srv = installed.server
    before = listing(installed.data)
    started = time.monotonic()
    op = provision(srv, {"id": CRASH, "image": RECIPE, "loadout": "minimal"}, timeout=600)
    elapsed = time.monotonic() - started
    print(f"agent crash: provision failed after {elapsed:.1f}s: {op['error']['cause']}")
    print("console:\n" + str(op["error"].get("diagnostics", ""))[-6000:])
    assert op["state"] == "failed", op
    assert op["error"]["stage"] == "enrolling", op["error"]
    cause = op["error"]["cause"]
    assert "exits at start" in cause and "did not enroll within" not in cause, cause
    assert "ImportError: cannot import name 'no_such_module'" in cause, cause
    assert "main.py" in cause, cause  # the traceback's last lines, not just its last one
    assert domains_named(f"sbx-{CRASH}") == []
    after = listing(installed.data)
    assert after == before, {"left": sorted(after - before), "gone": sorted(before - after)}
