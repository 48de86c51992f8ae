"""Processes a test starts end with the test run, even when the run is killed.

`die_with_parent` is a `preexec_fn`: the child asks the kernel (prctl PR_SET_PDEATHSIG) for a
SIGTERM when the process that started it goes away, so a killed or timed-out pytest leaves no
server or agent behind retrying for ever (and loading the machine for everyone else).
"""

from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def die_with_parent() -> None:
    _libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
