"""The cloud-init NoCloud seed: user-data, meta-data and network-config on an ISO9660 image with
volume id `cidata`, written in Python with pycdlib (Rock Ridge + Joliet, so the lower-case names
cloud-init looks for are there). `SeedFiles.front` goes into the image's system area (its first
32 KiB, which ISO9660 readers skip) as a record the guest's agent reads without mounting
(`agentic_sandbox/proto/seed_record.py`)."""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import pycdlib

from agentic_sandbox.proto import seed_record

VOLUME_ID = "cidata"


@dataclass(frozen=True)
class SeedFiles:
    user_data: str
    meta_data: str
    network_config: str | None = None
    vendor_data: str | None = None
    extra: dict[str, str] = field(default_factory=dict)  # more files (cloud-init ignores them)
    front: bytes = b""  # a payload for the system-area record (`seed_record`), when not empty

    def files(self) -> dict[str, bytes]:
        out = {"user-data": self.user_data.encode(), "meta-data": self.meta_data.encode()}
        if self.network_config is not None:
            out["network-config"] = self.network_config.encode()
        if self.vendor_data is not None:
            out["vendor-data"] = self.vendor_data.encode()
        for name, text in self.extra.items():
            out[name] = text.encode()
        return out


def _iso_name(name: str) -> str:
    """An ISO9660 level-1 name for `user-data` → `/USERDATA.;1` (8.3, upper case)."""
    stem = "".join(c for c in name.upper() if c.isalnum())[:8]
    return f"/{stem}.;1"


def write_seed_iso(path: Path, seed: SeedFiles) -> Path:
    """Write the seed atomically (temp file + rename), mode 0600 in a 0700 folder: it holds a
    one-time enrollment token. (The fleet copies it beside the instance's disk, where libvirt
    hands it to QEMU.)"""
    front = seed_record.pack(seed.front) if seed.front else b""
    iso = pycdlib.PyCdlib()
    iso.new(interchange_level=3, joliet=3, rock_ridge="1.09", vol_ident=VOLUME_ID)
    try:
        for name, data in seed.files().items():
            iso.add_fp(
                io.BytesIO(data),
                len(data),
                _iso_name(name),
                rr_name=name,
                joliet_path=f"/{name}",
            )
        tmp = path.with_name(path.name + ".tmp")
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)
            iso.write_fp(f)
            if front:  # pycdlib leaves the system area zero (no El Torito, no hybrid MBR)
                f.seek(0)
                f.write(front)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        iso.close()
    return path


def bind_to_member(path: Path, member_id: str) -> bool:
    """Mark the seed at `path` as the hand-off of warm-pool member `member_id`: its record
    gains `"standby_of": member_id`, so that member's agent may use the key it made while it
    stood by (`agent/runtime.py`); `member_id=""` takes the mark off again (the seed then goes
    to a clone instead). Only the record changes (the seed's identity file does not
    name the member: an agent that reads the file makes a fresh key). False when the seed has
    no record. The record is rewritten in one write and checked by its digest: one cut short
    is no record, and the agent then makes a fresh key, which is always safe."""
    with open(path, "r+b") as f:
        payload = seed_record.unpack(f.read(seed_record.SYSTEM_AREA))
        if payload is None:
            return False
        identity = json.loads(payload)
        if member_id:
            identity["standby_of"] = member_id
        else:
            identity.pop("standby_of", None)
        record = seed_record.pack(json.dumps(identity, separators=(",", ":")).encode())
        f.seek(0)
        f.write(record.ljust(seed_record.SYSTEM_AREA, b"\0"))
        f.flush()
        os.fsync(f.fileno())
    return True


def read_seed_iso(path: Path) -> dict[str, bytes]:
    """The files of a seed ISO by their Rock Ridge names (for tests and diagnostics)."""
    iso = pycdlib.PyCdlib()
    iso.open(str(path))
    try:
        out: dict[str, bytes] = {}
        for child in iso.list_children(rr_path="/"):
            if child.is_dot() or child.is_dotdot():
                continue
            name = child.rock_ridge.name().decode()
            buf = io.BytesIO()
            iso.get_file_from_iso_fp(buf, rr_path=f"/{name}")
            out[name] = buf.getvalue()
        vol = iso.pvd.volume_identifier.decode().strip()
        out[".volume_id"] = vol.encode()
        return out
    finally:
        iso.close()
