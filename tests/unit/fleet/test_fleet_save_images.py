"""Save-image header parsing and in-place rewriting."""

from __future__ import annotations

import struct

import pytest

from agentic_sandbox.fleet.libvirt.save_images import (
    QEMU_HEAD_LEN,
    SaveImageError,
    parse,
    prefix_length,
    rebuild,
)


def qemu_image(xml: bytes, cookie: bytes, data_len: int) -> bytes:
    body = xml + b"\0" + cookie + b"\0"
    body += b"\0" * (data_len - len(body))
    head = struct.pack("<16s5I56x", b"LibvirtQemudSave", 2, data_len, 1, 0, len(xml) + 1)
    return head + body + b"QEMU-STREAM"


def test_parse_qemu_header() -> None:
    img = qemu_image(b"<domain/>", b"<cookie/>", 4096)
    assert QEMU_HEAD_LEN == 92
    total = prefix_length(img[:QEMU_HEAD_LEN])
    assert total == 92 + 4096
    h = parse(img[:total])
    assert (h.kind, h.xml, h.cookie, h.was_running) == ("qemu", "<domain/>", b"<cookie/>", 1)


def test_rebuild_keeps_length_and_stream() -> None:
    img = qemu_image(b"<domain/>", b"<cookie/>", 4096)
    h = parse(img)
    new = rebuild(h, "<domain><name>longer name</name></domain>")
    assert len(new) == h.total_len
    patched = new + img[h.total_len :]
    assert patched.endswith(b"QEMU-STREAM")
    h2 = parse(patched)
    assert h2.xml == "<domain><name>longer name</name></domain>"
    assert h2.cookie == b"<cookie/>"


def test_rebuild_refuses_xml_that_does_not_fit() -> None:
    h = parse(qemu_image(b"<d/>", b"<c/>", 64))
    with pytest.raises(SaveImageError):
        rebuild(h, "<domain>" + "x" * 100 + "</domain>")


def test_test_driver_format() -> None:
    xml = b"<domain type='test'/>"
    img = struct.pack("<15si", b"TestGuestMagic\0", len(xml)) + xml
    h = parse(img)
    assert h.kind == "test" and h.xml == xml.decode()
    assert parse(rebuild(h, "<domain type='test'><name>n</name></domain>")).xml.endswith(
        "</domain>"
    )


@pytest.mark.parametrize("blob", [b"garbage" * 20, b"LibvirtQemudPart" + b"\0" * 80])
def test_bad_images(blob: bytes) -> None:
    with pytest.raises(SaveImageError):
        prefix_length(blob)
