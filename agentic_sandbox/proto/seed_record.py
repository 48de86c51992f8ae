"""The identity record at the front of a seed disk: what the provisioner writes and the guest's
agent reads without mounting anything.

A guest restored from a memory state (a clone, a warm-pool hand-off) must learn its new identity
from its new seed before it can enroll. Mounting the ISO to read `agentic-sandbox.json` takes
three processes (`blockdev`, `mount`, `umount`): about 0.6 s inside an emulated guest, on the
hand-off's critical path. So the provisioner also writes the same JSON in the ISO 9660 *system
area* — the first 16 sectors (32 KiB), which the standard leaves to the writer and every
ISO 9660 reader (the kernel, cloud-init, blkid) skips — and the agent reads it with the one
64 KiB direct read it already makes to notice a new seed (10-20 ms in a TCG guest).

Layout: `MAGIC` (16 bytes), the payload's length (4 bytes, big-endian), its SHA-256 (32 bytes),
the payload (UTF-8 JSON). A record that is absent, cut short or whose digest does not match is
no record (the agent then mounts the seed, as for a seed written before this record existed).
The seed disk is the host's (read-only to the guest), so this is exactly as trusted as the file.

A warm-pool member is restored with a *standby* seed of its own (`"standby": true`, its member
id, fresh `entropy`, the link's CA, no token): its agent reseeds the kernel's generator from it,
makes the key and CSR of the instance it will become and one warm-up connection through its
forward (closed unused), then writes `SPARE_KEY_READY` to its console (or `NO_SPARE_KEY` when it
made none), which the fleet waits for before it pauses the member. Only the hand-off's seed made
for that member uses that key: its record carries `"standby_of": "<member id>"` (added by the
server once the fleet has picked the member); any other seed, a clone's among them, makes a new
one.

Standard library only: the guest's agent imports it.
"""

from __future__ import annotations

import hashlib
import struct

MAGIC = b"SBX-IDENTITY-v1\n"
SPARE_KEY_READY = "agentic-sandbox: spare key ready"  # a standby member's console line
NO_SPARE_KEY = "agentic-sandbox: no spare key"  # or this one: it made none (pause it all the same)
SYSTEM_AREA = 16 * 2048  # ISO 9660: the sectors before the first volume descriptor
_HEAD = struct.Struct(">16sI32s")
MAX_PAYLOAD = SYSTEM_AREA - _HEAD.size


class RecordTooLarge(ValueError):
    pass


def pack(payload: bytes) -> bytes:
    """The record for `payload` (at most `MAX_PAYLOAD` bytes)."""
    if len(payload) > MAX_PAYLOAD:
        raise RecordTooLarge(
            f"the seed's identity record is {len(payload)} bytes; at most {MAX_PAYLOAD}"
        )
    return _HEAD.pack(MAGIC, len(payload), hashlib.sha256(payload).digest()) + payload


def unpack(head: bytes) -> bytes | None:
    """The payload of the record at the start of `head` (a seed disk's first bytes), or None."""
    if len(head) < _HEAD.size or not head.startswith(MAGIC):
        return None
    _, length, digest = _HEAD.unpack_from(head)
    if length > MAX_PAYLOAD or len(head) < _HEAD.size + length:
        return None
    payload = bytes(head[_HEAD.size : _HEAD.size + length])
    return payload if hashlib.sha256(payload).digest() == digest else None
