"""Lines that native libraries write to the process's stderr, as the server's own log records.

gRPC's C core logs through abseil, which writes straight to file descriptor 2
(``I1201 10:04:33.469489   17583 ssl_transport_security.cc:2563] Handshake failed …``), and grpcio
1.85 offers Python no hook to take those lines (``GRPC_VERBOSITY`` and ``GRPC_TRACE`` only choose
which are written). So the server points fd 2 at a pipe read by a small relay process
(``python -m agentic_sandbox.broker.observability.native_log FORMAT LEVEL``) that parses each line
and writes it as a log record in the server's format (JSON or text) on the real stderr: abseil
lines under the logger ``grpc.core`` at their own severity, with ``source`` (file:line) and, when
the line names one, the ``peer``; any other line under ``stderr`` as a warning. Python's own
writes (``sys.stderr``: the log handler, tracebacks) go to the real stderr directly.

A separate process rather than a thread: when the server dies (an abort in native code, a fatal
error), the relay still reads what is left in the pipe, writes it, and exits at end of file.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
from typing import TextIO

from agentic_sandbox.broker.observability.logs import configure_logging

NATIVE_LOGGER = "grpc.core"
OTHER_LOGGER = "stderr"

_ABSL = re.compile(
    r"^(?P<severity>[IWEF])\d{4} \d\d:\d\d:\d\d\.\d+\s+(?P<thread>\d+) "
    r"(?P<source>[\w./+-]+:\d+)\] ?(?P<message>.*)$"
)
_PEER = re.compile(
    r"(?P<peer>ipv4:\d{1,3}(?:\.\d{1,3}){3}:\d+"
    r"|ipv6:(?:\[[0-9A-Fa-f:.%]+\]|%5B[0-9A-Fa-f:.%]+%5D):\d+"
    r"|unix:[^\s,;)]+)"
)
_LEVELS = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}


def record_for(line: str) -> tuple[str, int, str, dict[str, str]]:
    """(logger, level, message, extra fields) for one line a native library wrote."""
    m = _ABSL.match(line)
    if m is None:
        return OTHER_LOGGER, logging.WARNING, line, {}
    extra = {"source": m["source"]}
    peer = _PEER.search(m["message"])
    if peer is not None:
        extra["peer"] = peer["peer"]
    return NATIVE_LOGGER, _LEVELS[m["severity"]], m["message"], extra


def relay(lines: TextIO) -> None:
    """Log each line read from `lines` until end of file."""
    for raw in lines:
        line = raw.rstrip("\r\n")
        if not line.strip():
            continue
        name, level, message, extra = record_for(line)
        logging.getLogger(name).log(level, "%s", message, extra=extra)


def route_native_stderr(level: str, fmt: str) -> subprocess.Popen[bytes]:
    """Point fd 2 at a relay process (see module doc); `sys.stderr` keeps the real stderr.
    Call before `configure_logging`, so the log handler writes to the real stderr."""
    read_end, write_end = os.pipe()
    real = os.dup(2)
    relay_proc = subprocess.Popen(
        [sys.executable, "-m", __name__, fmt, level],
        stdin=read_end,
        stdout=real,
        stderr=real,
        close_fds=True,
        start_new_session=True,  # Ctrl-C on the terminal is the server's; the relay ends at EOF
    )
    os.close(read_end)
    sys.stderr.flush()
    sys.stderr = os.fdopen(real, "w", buffering=1, encoding="utf-8", errors="backslashreplace")
    os.dup2(write_end, 2)
    os.close(write_end)
    return relay_proc


def main(argv: list[str]) -> int:
    fmt, level = argv[0], argv[1]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(level, fmt)
    relay(sys.stdin)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
