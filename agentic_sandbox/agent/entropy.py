"""Fresh randomness for a restored guest's kernel.

A guest restored from saved memory (a clone of a memory snapshot, a warm-pool hand-off) resumes
with the state of its kernel's random generator as it was at the save: every guest restored
from one save draws the same numbers until its kernel reseeds on its own (a minute later at
worst), so two tenants handed members of one pool could predict each other's keys, and two
clones make the same machine-id. The device made for this (vmgenid) needs a driver that
Debian's cloud kernel does not build, so the agent does it: every seed carries random bytes
made on the host for that incarnation (`entropy` in the identity record), which the agent
adds to the kernel's input pool with credit (`RNDADDENTROPY`) and then has the generator
reseed from the pool at once (`RNDRESEEDCRNG`), before it makes the new instance's key,
machine-id or SSH host keys. Root only (CAP_SYS_ADMIN); the agent runs as root in a guest.

What this does not reach: user-space generators seeded before the save in processes that
keep running (the agent's own TLS library inside gRPC draws from a per-thread generator it
seeded when it started). Their output goes into TLS handshakes with the server only (client
random and key share, each mixed with the server's own fresh randomness); reading it would
need the host's side of the forward. Processes started after the hand-off seed from the
reseeded kernel.

Only the standard library: this runs inside the guest.
"""

from __future__ import annotations

import fcntl
import os
import struct

RNDADDENTROPY = 0x40085203  # _IOW('R', 0x03, int[2])
RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07)
MIN_BYTES = 16  # less than this from the host is not worth crediting as a reseed
MAX_BYTES = 512
DEVICE = "/dev/urandom"


class ReseedFailed(OSError):
    """The kernel did not take the bytes (not root, no such ioctl): the message says which."""


def reseed_kernel_rng(data: bytes, device: str = DEVICE) -> None:
    """Add `data` (random bytes from the host) to the kernel's input pool, credited at 8 bits
    a byte, then reseed the kernel's generator from the pool."""
    if not MIN_BYTES <= len(data) <= MAX_BYTES:
        raise ValueError(f"entropy: {len(data)} bytes; between {MIN_BYTES} and {MAX_BYTES}")
    pad = (-len(data)) % 4  # the kernel's buffer is of 32-bit words
    info = struct.pack("ii", len(data) * 8, len(data)) + data + b"\0" * pad
    fd = os.open(device, os.O_WRONLY | os.O_CLOEXEC)
    try:
        try:
            fcntl.ioctl(fd, RNDADDENTROPY, info)
        except OSError as exc:
            raise ReseedFailed(exc.errno, f"adding entropy to {device}: {exc.strerror}") from None
        try:
            fcntl.ioctl(fd, RNDRESEEDCRNG)
        except OSError as exc:
            raise ReseedFailed(exc.errno, f"reseeding from {device}: {exc.strerror}") from None
    finally:
        os.close(fd)
