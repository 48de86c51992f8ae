"""Starting a run's process without Python in the child: what `execve` would refuse, found
before a spawn that goes through a wrapper (a held start's `/bin/sh`, `setsid`), where the
wrapper's own exec would otherwise be the one to fail, after the spawn had succeeded.

Shared by exec (`exec.py`) and PTY sessions (`session.py`). Only the standard library: this
runs inside the guest.
"""

from __future__ import annotations

import os
import pwd
import signal
import stat
import threading

EXEC_MAGIC = (b"\x7fELF", b"#!")
SH = "/bin/sh"
#: a held start: wait for the agent's line on stdin (the run's cgroup joined), then become the
#: command (same pid, the argv as given, the same PATH search as `execve`'s callers); an agent
#: gone before it (EOF) means the command never runs
HOLD = 'IFS= read -r _ || exit 126; exec "$0" "$@"'
#: a PTY session's held start: its stdin is the hold's pipe, its stdout the PTY, which becomes
#: its stdin as it execs the command (`setsid --ctty …`, which needs the PTY on stdin)
HOLD_THEN_PTY = 'IFS= read -r _ || exit 126; exec "$0" "$@" <&1'


def program_problem(argv0: str, env: dict[str, str], cwd: str, user: pwd.struct_passwd) -> str:
    """Why `execve` would refuse `argv0` ("" when it would not): the program found as `Popen`
    would (a path relative to `cwd`, else a search of the run's PATH), a regular file `user`
    may execute, and a program (ELF or `#!`), not a file a shell would run as a script."""
    if "\x00" in argv0 or "\x00" in cwd or "\x00" in env.get("PATH", ""):
        return f"cannot run {argv0!r}: a NUL byte in the program, its PATH or working directory"
    if "/" in argv0:
        candidates = [os.path.join(cwd, argv0)]
    else:
        candidates = [os.path.join(d or ".", argv0) for d in os.get_exec_path(env)]
    denied = False
    for path in candidates:
        try:
            st = os.stat(path)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        if user.pw_uid == 0:
            allowed = bool(st.st_mode & 0o111)
        elif st.st_uid == user.pw_uid:
            allowed = bool(st.st_mode & stat.S_IXUSR)
        elif st.st_gid == user.pw_gid or st.st_gid in os.getgrouplist(user.pw_name, user.pw_gid):
            allowed = bool(st.st_mode & stat.S_IXGRP)
        else:
            allowed = bool(st.st_mode & stat.S_IXOTH)
        if not allowed:
            denied = True
            continue
        try:
            with open(path, "rb") as f:
                head = f.read(4)
        except OSError:
            return ""  # not readable here: execve decides
        if not head.startswith(EXEC_MAGIC):
            return f"cannot run {argv0!r}: Exec format error"
        return ""
    why = "Permission denied" if denied else "No such file or directory"
    return f"cannot run {argv0!r}: {why}"


#: what a terminal sends, which a run's process must start able to receive
TERMINAL_SIGNALS = (
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGTSTP,
    signal.SIGTTIN,
    signal.SIGTTOU,
    signal.SIGHUP,
)


def _ignore(signum: int, frame: object) -> None:
    """As SIG_IGN for the agent, but an exec resets a handled signal to its default action."""


def unignore_terminal_signals() -> None:
    """An ignored signal stays ignored across fork and exec, so a run started by an agent that
    was itself started with SIGINT ignored (a background job of a script, `nohup` for SIGHUP)
    could not be interrupted. Each such signal gets a handler that does nothing: the agent
    still ignores it, and its children start with the default action. (Only the main thread
    may set handlers; the agent spawns from its loop, which is it.)"""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in TERMINAL_SIGNALS:
        if signal.getsignal(signum) == signal.SIG_IGN:
            signal.signal(signum, _ignore)
