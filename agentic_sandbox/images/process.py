"""Cancellable subprocesses: argv lists only, output to the build log, process-group kill."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

from agentic_sandbox.images.errors import BuildCancelled, BuildError

#: How long a cancelled process group gets between SIGTERM and SIGKILL.
KILL_GRACE_S = 3.0

LineHandler = Callable[[str], None]


class CommandRunner:
    """Runs build commands one at a time, each in its own process group.

    Output (stdout and stderr merged) is appended to `log` line by line; an optional handler sees
    each line (for progress). A set `cancel` event, or a timeout, kills the whole process group
    (SIGTERM, then SIGKILL) and raises BuildCancelled / BuildError.
    """

    def __init__(self, log: IO[str], cancel: threading.Event | None = None) -> None:
        self.log = log
        self.cancel = cancel if cancel is not None else threading.Event()
        self._lock = threading.Lock()

    def check_cancel(self) -> None:
        if self.cancel.is_set():
            raise BuildCancelled("build cancelled")

    def write(self, text: str) -> None:
        with self._lock:
            self.log.write(text if text.endswith("\n") else text + "\n")
            self.log.flush()

    def run(
        self,
        argv: Sequence[str | Path],
        *,
        stage: str,
        timeout: float = 3600.0,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        on_line: LineHandler | None = None,
        capture: bool = False,
    ) -> str:
        """Run `argv` to completion. Returns captured stdout when `capture` (stderr goes to log)."""
        self.check_cancel()
        args = [str(a) for a in argv]
        if not args or any("\0" in a for a in args):
            raise BuildError(stage, "invalid command line")
        self.write(f"$ {' '.join(args)}")
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE if capture else subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
                text=True,
                errors="replace",
            )
        except OSError as err:
            raise BuildError(stage, f"cannot run {args[0]}: {err}", self.log.name) from None

        captured: list[str] = []
        readers = []
        assert proc.stdout is not None
        readers.append(
            threading.Thread(
                target=self._pump,
                args=(proc.stdout, captured if capture else None, None if capture else on_line),
                daemon=True,
            )
        )
        if capture:
            assert proc.stderr is not None
            readers.append(
                threading.Thread(target=self._pump, args=(proc.stderr, None, on_line), daemon=True)
            )
        for t in readers:
            t.start()
        try:
            while True:
                try:
                    rc = proc.wait(timeout=0.1)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if self.cancel.is_set():
                    kill_group(proc)
                    self.write(f"! cancelled: killed {args[0]} (pid {proc.pid})")
                    raise BuildCancelled("build cancelled")
                if time.monotonic() - started > timeout:
                    kill_group(proc)
                    raise BuildError(
                        stage, f"{args[0]} timed out after {timeout:.0f} s", self.log.name
                    )
        except BaseException:
            kill_group(proc)
            raise
        finally:
            # The leader is gone; anything it left behind in its group goes too (a daemon that a
            # package script started in the chroot would otherwise keep the rootfs busy).
            kill_group(proc, grace=0.0)
            for t in readers:
                t.join(timeout=5)
        elapsed = time.monotonic() - started
        self.write(f"# exit {rc} after {elapsed:.1f} s")
        if rc != 0:
            raise BuildError(stage, f"{args[0]} exited with status {rc}", self.log.name)
        return "".join(captured)

    def _pump(self, stream: IO[str], sink: list[str] | None, on_line: LineHandler | None) -> None:
        for line in stream:
            if sink is not None:
                sink.append(line)
                continue
            self.write(line)
            if on_line is not None:
                try:
                    on_line(line.rstrip("\n"))
                except Exception:  # a progress handler must never break the build
                    pass
        stream.close()


def kill_group(proc: subprocess.Popen[str], grace: float = KILL_GRACE_S) -> None:
    """SIGTERM the process group of `proc`, wait up to `grace`, then SIGKILL it and reap."""
    pgid = proc.pid
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    except PermissionError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if proc.poll() is not None and not _group_alive(pgid):
            break
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _group_alive(pgid: int) -> bool:
    """True while a non-zombie process is in group `pgid` (zombies reparented to an init that
    does not reap promptly must not stretch every kill to the full grace time)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False
