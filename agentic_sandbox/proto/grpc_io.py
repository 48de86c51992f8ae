"""How gRPC's core does its I/O in our processes (the server and the agent), set before gRPC loads.

gRPC core (1.85) reads `GRPC_EXPERIMENTS` once, when `grpc` is imported. By default its
EventEngine does a channel's and a listener's socket I/O on threads of its own (a poller thread
and a thread pool), and hands each finished operation to the completion queue, which
`grpc.aio`'s own poller thread then hands to the asyncio loop: every message read or written on
the agent link crosses two or three threads before the loop sees it. With the EventEngine
client and listener turned off, the completion queue's poller thread does the socket work
itself (core's polling engine, still supported and the default until 1.6x), so one thread hop
is left per operation.

Measured on this 2-core machine with a bidirectional stream on loopback (8-byte messages,
server and client pinned to a core each, interleaved runs): round trip p50 205-219 µs ->
122-154 µs; CPU per round trip: client 147-153 -> 100-113 µs, server about a third less.
The agent link's keystroke path and exec answers are such round trips (see
`tests/bench/bench_sessions.py` and `tests/bench/bench_exec.py` for the whole path).

`use_polling_io()` must run before anything imports `grpc`; each entry point that speaks the
agent link calls it first (`broker/main.py`, `agent/main.py`; a unit test checks that neither
has loaded gRPC by then). An operator who sets `GRPC_EXPERIMENTS` themselves (even to an empty
value) keeps exactly what they set. Standard library only: the guest's agent imports it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

ENV = "GRPC_EXPERIMENTS"
#: The EventEngine experiments turned off: a channel's (`event_engine_client`) and a server's
#: (`event_engine_listener`) connections then run on core's polling engine.
POLLING_IO = "-event_engine_client,-event_engine_listener"


def use_polling_io(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set `GRPC_EXPERIMENTS` for this process and its children unless the operator set it.
    False when it cannot take effect here: gRPC is already loaded (a process that imported it
    first, such as a test runner) and keeps what it was loaded with."""
    env = os.environ if environ is None else environ
    if ENV in env:
        return env[ENV] == POLLING_IO
    if "grpc" in sys.modules:
        return False
    env[ENV] = POLLING_IO
    return True
