"""The header of a libvirt save image (``virDomainSave``), read and rewritten in place.

libvirt refuses a restore whose replacement XML changes the domain UUID, so restoring a saved
state as a *new* domain means rewriting the XML stored in the image itself. libvirt's QEMU driver
pads that XML region (tens of KiB), so a rewritten XML of similar size fits without moving the
memory stream that follows.

QEMU driver layout (little endian): magic[16] version data_len was_running compressed
cookie_offset unused[14] (92 bytes), then ``data_len`` bytes: XML, NUL, cookie XML, NUL, zero
padding, then QEMU's migration stream.

libvirt's test driver (used by the fast test tier) writes magic ``TestGuestMagic\\0``, an int
length and the XML; that whole file is the header.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

QEMU_MAGIC = b"LibvirtQemudSave"
QEMU_PARTIAL_MAGIC = b"LibvirtQemudPart"
_QEMU_HEAD = struct.Struct("<16s5I56x")
QEMU_HEAD_LEN = _QEMU_HEAD.size  # 92
TEST_MAGIC = b"TestGuestMagic\0"
_TEST_HEAD = struct.Struct("<15si")


class SaveImageError(ValueError):
    pass


@dataclass(frozen=True)
class SaveHeader:
    kind: str  # "qemu" | "test"
    xml: str
    total_len: int  # bytes of the file that make up the header region
    version: int = 0
    was_running: int = 0
    compressed: int = 0
    cookie: bytes = b""
    data_len: int = 0

    @property
    def definition(self) -> str:
        """The domain XML in the header (the driver protocol's `SavedImage`)."""
        return self.xml


def prefix_length(first: bytes) -> int:
    """How many leading bytes hold the header, given at least the first 92 (or 19) bytes."""
    if first.startswith(QEMU_PARTIAL_MAGIC):
        raise SaveImageError("save image is incomplete (libvirt was interrupted writing it)")
    if first.startswith(QEMU_MAGIC):
        if len(first) < QEMU_HEAD_LEN:
            raise SaveImageError("short save image header")
        _, _version, data_len, _, _, _ = _QEMU_HEAD.unpack_from(first)
        return int(QEMU_HEAD_LEN + data_len)
    if first.startswith(TEST_MAGIC):
        _, length = _TEST_HEAD.unpack_from(first)
        return int(_TEST_HEAD.size + length)
    raise SaveImageError("not a libvirt save image")


def parse(head: bytes) -> SaveHeader:
    total = prefix_length(head)
    if len(head) < total:
        raise SaveImageError("short save image header")
    if head.startswith(TEST_MAGIC):
        xml = head[_TEST_HEAD.size : total].split(b"\0", 1)[0].decode()
        return SaveHeader(kind="test", xml=xml, total_len=total)
    _, version, data_len, was_running, compressed, cookie_off = _QEMU_HEAD.unpack_from(head)
    data = head[QEMU_HEAD_LEN:total]
    xml = data.split(b"\0", 1)[0].decode()
    cookie = b""
    if version >= 2 and cookie_off:
        cookie = data[cookie_off:].split(b"\0", 1)[0]
    return SaveHeader("qemu", xml, total, version, was_running, compressed, cookie, data_len)


def rebuild(header: SaveHeader, new_xml: str, *, running: bool | None = None) -> bytes:
    """The header bytes with ``new_xml``. For the QEMU format the result has exactly the old
    length (it is written over the old header in place); raises if the XML does not fit."""
    xml = new_xml.encode()
    if header.kind == "test":
        return _TEST_HEAD.pack(TEST_MAGIC, len(xml) + 1) + xml + b"\0"
    body = xml + b"\0"
    cookie_off = 0
    if header.version >= 2 and header.cookie:
        cookie_off = len(body)
        body += header.cookie + b"\0"
    if len(body) > header.data_len:
        raise SaveImageError(
            f"rewritten XML ({len(xml)} bytes) does not fit the save image's {header.data_len}-byte"
            " header region"
        )
    body += b"\0" * (header.data_len - len(body))
    was_running = header.was_running if running is None else int(running)
    head = _QEMU_HEAD.pack(
        QEMU_MAGIC, header.version, header.data_len, was_running, header.compressed, cookie_off
    )
    return head + body
