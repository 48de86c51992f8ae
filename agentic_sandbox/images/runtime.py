"""The agent runtime: wheels fetched on the host, a venv built in the chroot by the guest's python.

Wheels are downloaded once per (requirements, python version, platforms) into the cache's
wheelhouse with the host's pip (so the host's pip configuration and any local mirror apply), then
copied into the tree and installed with `--no-index`: the chroot itself never needs a network.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from pathlib import Path

from agentic_sandbox.images.errors import BuildError
from agentic_sandbox.images.mounts import mounted_proc, remove_tree
from agentic_sandbox.images.process import CommandRunner
from agentic_sandbox.images.recipe import AgentRuntime

#: Environment for commands run inside the chroot: nothing of the host's leaks in.
CHROOT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "DEBIAN_FRONTEND": "noninteractive",
    "PIP_NO_INPUT": "1",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    "PIP_NO_CACHE_DIR": "1",
}

GUEST_WHEELS_DIR = "/tmp/agentic-wheels"
LOCK_NAME = "requirements.lock.txt"  # the recipe's lock, kept beside the wheels it pins

IMPORT_CHECK = "import grpc, google.protobuf, ptyprocess"


def _lock_text(runtime: AgentRuntime) -> str | None:
    path = runtime.lock_path()
    return None if path is None else path.read_text(encoding="utf-8")


def wheelhouse_key(runtime: AgentRuntime) -> str:
    blob = json.dumps(
        {
            "requirements": runtime.requirements,
            "lock": _lock_text(runtime),
            "python": runtime.python_version,
            "platforms": runtime.wheel_platforms,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _requirement_args(runtime: AgentRuntime, lock_copy: str | None) -> list[str]:
    """What pip installs: the hash-pinned lock when the recipe has one, else the pins."""
    if lock_copy is not None:
        return ["--require-hashes", "-r", lock_copy]
    return list(runtime.requirements)


def ensure_wheelhouse(
    runner: CommandRunner, pip: list[str], wheels_root: Path, runtime: AgentRuntime
) -> Path:
    """A directory of wheels for `runtime`, downloaded once and reused (atomic rename)."""
    dest = wheels_root / wheelhouse_key(runtime)
    if (dest / ".complete").is_file():
        runner.write(f"# wheelhouse {dest} (cached)")
        return dest
    wheels_root.mkdir(parents=True, exist_ok=True)
    tmp = wheels_root / f".tmp-{dest.name}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        argv = [
            *pip,
            "download",
            "--disable-pip-version-check",
            "--no-input",
            "--only-binary=:all:",
            "--implementation",
            "cp",
            "--python-version",
            runtime.python_version,
            "--abi",
            "cp" + runtime.python_version.replace(".", ""),
        ]
        for platform in runtime.wheel_platforms:
            argv += ["--platform", platform]
        lock = runtime.lock_path()
        if lock is not None:
            shutil.copyfile(lock, tmp / LOCK_NAME)
        argv += ["--dest", str(tmp), *_requirement_args(runtime, str(lock) if lock else None)]
        runner.run(argv, stage="wheels", timeout=900)
        (tmp / ".complete").write_text("\n".join(runtime.requirements) + "\n")
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / ".complete").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def chroot_argv(chroot: str, root: Path, *argv: str) -> list[str]:
    return [chroot, str(root), *argv]


def guest_python_version(runner: CommandRunner, chroot: str, root: Path, python: str) -> str:
    code = "import sys; print('%d.%d.%d' % sys.version_info[:3])"
    out = runner.run(
        chroot_argv(chroot, root, python, "-c", code),
        stage="runtime",
        env=CHROOT_ENV,
        capture=True,
        timeout=120,
    )
    return out.strip()


def install_runtime(
    runner: CommandRunner, chroot: str, root: Path, runtime: AgentRuntime, wheelhouse: Path
) -> dict[str, str]:
    """Create the venv in the guest tree and install the pinned requirements into it.

    Returns {distribution: version} as the venv's pip reports it.
    """
    version = guest_python_version(runner, chroot, root, runtime.python)
    if not version.startswith(runtime.python_version + "."):
        raise BuildError(
            "runtime",
            f"guest python is {version} but the recipe's runtime.python_version is "
            f"{runtime.python_version}",
            runner.log.name,
        )
    venv = runtime.venv_path
    venv_python = f"{venv}/bin/python"
    staged = root / GUEST_WHEELS_DIR.lstrip("/")
    if staged.exists():
        remove_tree(staged)
    shutil.copytree(wheelhouse, staged)
    try:
        with mounted_proc(root):
            runner.run(
                chroot_argv(chroot, root, runtime.python, "-m", "venv", venv),
                stage="runtime",
                env=CHROOT_ENV,
                timeout=600,
            )
            runner.run(
                chroot_argv(
                    chroot,
                    root,
                    venv_python,
                    "-m",
                    "pip",
                    "install",
                    "--no-index",
                    "--find-links",
                    GUEST_WHEELS_DIR,
                    *_requirement_args(
                        runtime,
                        f"{GUEST_WHEELS_DIR}/{LOCK_NAME}" if runtime.requirements_lock else None,
                    ),
                ),
                stage="runtime",
                env=CHROOT_ENV,
                timeout=900,
            )
            runner.run(
                chroot_argv(chroot, root, venv_python, "-c", IMPORT_CHECK),
                stage="runtime",
                env=CHROOT_ENV,
                timeout=120,
            )
            listing = runner.run(
                chroot_argv(chroot, root, venv_python, "-m", "pip", "list", "--format=json"),
                stage="runtime",
                env=CHROOT_ENV,
                timeout=120,
                capture=True,
            )
    finally:
        remove_tree(staged)
    try:
        packages = {p["name"]: p["version"] for p in json.loads(listing)}
    except (ValueError, KeyError, TypeError):
        raise BuildError("runtime", "pip list printed no usable JSON", runner.log.name) from None
    return packages
