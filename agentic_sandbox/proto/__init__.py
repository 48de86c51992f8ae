"""The agent-link contract: `agent.proto`'s generated code, and the names both sides use.

`PROTOCOL` is the link protocol this code speaks, sent in `Register.protocol` and
`RegisterAck.protocol`; it changes only when a change to `agent.proto` would break the other
side. A server speaks `PROTOCOLS` (oldest, newest) and refuses an agent outside them with
`FAILED_PRECONDITION` and `PROTOCOL_METADATA: "<oldest>-<newest>"`; the agent names the
mismatch in its log and the server in the agent's state (`incompatible`), and the agent keeps
retrying at its longest backoff (an upgraded server or agent ends it) — never a crash loop.

`BATCH_BYTES` and `BATCH_MESSAGES` bound a batch (`AgentBatch`, `ServerBatch`): a sender adds
ready messages to one write until it holds `BATCH_MESSAGES` or at least `BATCH_BYTES` (so a
batch is at most that plus one message, well under the link's 4 MiB message limit). Both sides
say they take batches (`Register.batches`, `RegisterAck.batches`); neither sends one otherwise.

`LEADER_METADATA` is the trailing-metadata key of a follower's answer (several control hosts,
one leads): a follower refuses `Enroll`, `Renew` and `Connect` with `UNAVAILABLE` and names the
leader as `"<node> <agent-link address>"` under this key, so an agent dials the leader next.

`SYNC_HOST` and `SYNC_HEADER` are the guest forward's sync (see `broker/agentlink/gateway.py`
and `agent/channels.py`): a `CONNECT` to `SYNC_HOST` carrying a nonce under `SYNC_HEADER`, which
the gateway answers at once with the nonce echoed, so the agent can drop what waited before it.
"""

from collections.abc import Callable
from typing import TypeVar

from google.protobuf.message import Message

M = TypeVar("M", bound=Message)

LEADER_METADATA = "sandbox-leader"
SYNC_HOST = b"sync.agentic-sandbox.invalid:0"
SYNC_HEADER = b"sandbox-sync"

PROTOCOL = 1
PROTOCOLS = (1, 1)  # what a server speaks: (oldest, newest)
PROTOCOL_METADATA = "sandbox-protocol"

BATCH_BYTES = 256 * 1024
BATCH_MESSAGES = 64


def gather(first: M, take: Callable[[], M | None], batch: Callable[[list[M]], M]) -> M:
    """`first`, or — when `take()` has more ready — `batch([first, …])` within the bounds
    above (the agent's and the server's sender alike)."""
    size = first.ByteSize()
    if size >= BATCH_BYTES:
        return first
    ready = [first]
    while size < BATCH_BYTES and len(ready) < BATCH_MESSAGES:
        msg = take()
        if msg is None:
            break
        ready.append(msg)
        size += msg.ByteSize()
    return first if len(ready) == 1 else batch(ready)


def protocol_of(sent: int) -> int:
    """The protocol a `Register.protocol` means (0: an agent from before versions: 1)."""
    return sent or 1
