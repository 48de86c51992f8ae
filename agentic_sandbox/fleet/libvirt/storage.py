"""Disks and files on a host, through libvirt storage pools.

Each host has three directory pools (created on first use, persistent, autostarted), named
``sbx-<kind>-<hash of the data directory>`` so several data directories (tests) never share one:

========== ======================= ==========================================================
pool       directory               holds
========== ======================= ==========================================================
bases      <data_dir>/bases        base images, kernels, initrds (read-only for guests)
instances  <data_dir>/instances    per instance: ``<domain>.qcow2`` overlay, ``<domain>.seed.iso``,
                                   ``<domain>.serial.log``
states     <data_dir>/states       saved memory states: ``<state>.save`` + ``<state>.qcow2``
========== ======================= ==========================================================

Overlays are qcow2 linked clones: on a host whose files are local, ``qemu-img create -b`` (argv,
~9 ms); on a remote host libvirt's ``virStorageVolCreateXML`` with a ``<backingStore>`` (~12 ms
plus the round trip). Files that come from this machine
(seed ISOs, base images) are copied directly when the host's files are local, and streamed through
``virStorageVolUpload`` when they are not; the same split applies to reading serial logs and
patching save-image headers. All methods here block: the fleet runs them in its executor.

libvirt's test driver keeps volumes virtual; its pools here point at real directories so files
the fleet writes itself (seeds, save images) exist, while overlays stay virtual.

A saved state's frozen disk (``states/<state>.qcow2``) is the backing file of every overlay
restored from it, and of the frozen disk of any state captured from such a clone. Deleting a
state removes its memory image (``.save``) at once; the frozen disk stays while any qcow2 in
the host's ``instances/`` or ``states/`` is backed by it — read from the images' own headers
(or libvirt's volume XML where files are not local), so the count survives restarts — and
`collect_frozen_disks` removes it with the last of them.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Callable, Collection

import libvirt

from ..driver import ByteProgress
from ..errors import FleetError, NotFound
from ..models import DOMAIN_PREFIX, InstanceRecord
from ..qemu_access import guard_dir
from . import save_images

POOL_KINDS = ("bases", "instances", "states")
POOL_PREFIX = "sbx-"
_CHUNK = 1 << 20
DIGEST_SUFFIX = ".sha256"  # beside a verified image: its SHA-256, written after the readback
PROGRESS_STEPS = 50  # an upload reports its bytes at most this often (and at its end)


def counting_reader(
    read: Callable[[int], bytes], total: int, progress: ByteProgress | None
) -> Callable[[int], bytes]:
    """``read``, telling ``progress`` how far it got each time another 1/`PROGRESS_STEPS` of
    ``total`` has gone by, and at the end: a few dozen calls per upload, never one per chunk."""
    if progress is None:
        return read
    step = max(1, total // PROGRESS_STEPS)
    done = 0
    told = 0

    def counted(n: int) -> bytes:
        nonlocal done, told
        data = read(n)
        done += len(data)
        if done - told >= step or (done >= total and told < done) or (not data and told < done):
            told = done
            progress(done, total)
        return data

    return counted


def pool_name(kind: str, data_dir: str) -> str:
    return f"{POOL_PREFIX}{kind}-{hashlib.sha256(data_dir.encode()).hexdigest()[:8]}"


def _pool_xml(name: str, path: str) -> str:
    pool = ET.Element("pool", {"type": "dir"})
    ET.SubElement(pool, "name").text = name
    target = ET.SubElement(pool, "target")
    ET.SubElement(target, "path").text = path
    perms = ET.SubElement(target, "permissions")
    ET.SubElement(perms, "mode").text = "0755"
    return ET.tostring(pool, encoding="unicode")


_QCOW2_MAGIC = b"QFI\xfb"


def qcow2_backing(path: str) -> str | None:
    """The backing file a local qcow2 image names in its header (absolute), or None."""
    try:
        with open(path, "rb") as f:
            head = f.read(20)
            if len(head) < 20 or head[:4] != _QCOW2_MAGIC:
                return None
            offset, size = struct.unpack(">QI", head[8:20])
            if not offset or not size or size > 4096:
                return None
            f.seek(offset)
            name = f.read(size).decode("utf-8", "surrogateescape")
    except FileNotFoundError:
        return None
    return os.path.normpath(os.path.join(os.path.dirname(path), name))


def _no_such(err: libvirt.libvirtError) -> bool:
    return err.get_error_code() in (
        libvirt.VIR_ERR_NO_STORAGE_VOL,
        libvirt.VIR_ERR_NO_STORAGE_POOL,
        libvirt.VIR_ERR_NO_DOMAIN,
    )


class HostStorage:
    """Storage of one host. ``files_local``: the host's paths are this machine's paths."""

    def __init__(
        self,
        conn: libvirt.virConnect,
        data_dir: str,
        *,
        files_local: bool,
        qemu_gid: int | None = None,
    ) -> None:
        self.conn = conn
        self.data_dir = data_dir
        self.files_local = files_local
        self.qemu_gid = qemu_gid
        self.virtual = conn.getType() == "TEST"
        self.dirs: dict[str, str] = {}
        self._pools: dict[str, libvirt.virStoragePool] = {}

    # ------------------------------------------------------------------ pools

    def ensure_pools(self) -> None:
        for kind in POOL_KINDS:
            name = pool_name(kind, self.data_dir)
            path = os.path.join(self.data_dir, kind)
            try:
                pool = self.conn.storagePoolLookupByName(name)
            except libvirt.libvirtError as e:
                if not _no_such(e):
                    raise
                if self.files_local or self.virtual:
                    os.makedirs(path, mode=0o700, exist_ok=True)
                pool = self.conn.storagePoolDefineXML(_pool_xml(name, path), 0)
                with contextlib.suppress(libvirt.libvirtError):
                    pool.build(0)
                with contextlib.suppress(libvirt.libvirtError):
                    pool.setAutostart(1)
            if not pool.isActive():
                pool.create(0)
            else:
                with contextlib.suppress(libvirt.libvirtError):
                    pool.refresh(0)
            root = ET.fromstring(pool.XMLDesc(0))
            self.dirs[kind] = root.findtext("target/path", path)
            self._pools[kind] = pool
        for p in (self.data_dir, *self.dirs.values()):
            if (self.files_local or self.virtual) and os.path.isdir(p):
                guard_dir(p, self.qemu_gid)  # QEMU traverses to its files; no other user

    def forget_pools(self) -> None:
        """Undefine the pools (their files stay)."""
        for pool in self._pools.values():
            with contextlib.suppress(libvirt.libvirtError):
                if pool.isActive():
                    pool.destroy()
            with contextlib.suppress(libvirt.libvirtError):
                pool.undefine()
        self._pools.clear()

    def pool(self, kind: str) -> libvirt.virStoragePool:
        return self._pools[kind]

    def path(self, kind: str, name: str) -> str:
        return os.path.join(self.dirs[kind], name)

    def holds(self, kind: str, path: str) -> bool:
        folder = self.dirs.get(kind, "").rstrip("/") + "/"
        return bool(path) and path.startswith(folder)

    # ------------------------------------------------------------------ volumes

    def _vol(self, path: str, *, refresh_kind: str | None = None) -> libvirt.virStorageVol | None:
        try:
            return self.conn.storageVolLookupByPath(path)
        except libvirt.libvirtError as e:
            if not _no_such(e):
                raise
        if refresh_kind is None:
            refresh_kind = next((k for k, d in self.dirs.items() if path.startswith(d + "/")), None)
        if refresh_kind is not None:
            with contextlib.suppress(libvirt.libvirtError):
                self._pools[refresh_kind].refresh(0)
            try:
                return self.conn.storageVolLookupByPath(path)
            except libvirt.libvirtError as e:
                if not _no_such(e):
                    raise
        return None

    def exists(self, path: str) -> bool:
        if self.files_local and not self.virtual and os.path.exists(path):
            return True
        return self._vol(path) is not None

    def capacity(self, path: str) -> int:
        vol = self._vol(path)
        if vol is None:
            raise NotFound(f"no volume {path}")
        return int(vol.info()[1])

    def image_path(self, name: str) -> str:
        path = self.path("bases", name)
        if not self.exists(path):
            raise NotFound(f"image {name!r} is not in the host's image store ({path})")
        return path

    def create_overlay(self, kind: str, name: str, backing: str, capacity: int | None) -> str:
        """A qcow2 linked clone of ``backing`` (never written).

        Local files: ``qemu-img create`` directly (~9 ms); otherwise libvirt's volume API (which
        runs the same on the host, ~12 ms plus the round trip)."""
        if self.files_local and not self.virtual:
            dest = self.path(kind, name)
            argv = ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", backing, dest]
            if capacity is not None:
                argv.append(str(int(capacity)))
            proc = subprocess.run(argv, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(dest)
                if "No such file" in proc.stderr or "Could not open" in proc.stderr:
                    raise NotFound(f"cannot open backing image {backing}: {proc.stderr.strip()}")
                raise FleetError(f"qemu-img create failed: {proc.stderr.strip()}", stage="disk")
            os.chmod(dest, 0o600)
            return dest
        if capacity is None:
            capacity = self.capacity(backing)
        vol = ET.Element("volume")
        ET.SubElement(vol, "name").text = name
        ET.SubElement(vol, "capacity", {"unit": "bytes"}).text = str(int(capacity))
        target = ET.SubElement(vol, "target")
        ET.SubElement(target, "format", {"type": "qcow2"})
        perms = ET.SubElement(target, "permissions")
        ET.SubElement(perms, "mode").text = "0600"
        bs = ET.SubElement(vol, "backingStore")
        ET.SubElement(bs, "path").text = backing
        ET.SubElement(bs, "format", {"type": "qcow2"})
        created = self._pools[kind].createXML(ET.tostring(vol, encoding="unicode"), 0)
        return str(created.path())

    def put_file(
        self,
        kind: str,
        name: str,
        source: str,
        *,
        mode: int = 0o600,
        progress: ByteProgress | None = None,
    ) -> str:
        """Copy a local file into a pool (by link/copy when local, by upload stream if not);
        ``progress`` hears how many bytes are there as it goes."""
        dest = self.path(kind, name)
        size = os.path.getsize(source)
        if progress is not None:
            progress(0, size)
        if self.files_local or self.virtual:
            tmp = dest + ".part"
            shutil.copyfile(source, tmp)  # one kernel-side copy: its end is all there is to tell
            os.chmod(tmp, mode)
            os.replace(tmp, dest)
            if self.virtual:  # let the test driver know the volume too
                self._virtual_volume(kind, name, os.path.getsize(dest))
            if progress is not None:
                progress(size, size)
            return dest
        vol_el = ET.Element("volume")
        ET.SubElement(vol_el, "name").text = name
        ET.SubElement(vol_el, "capacity", {"unit": "bytes"}).text = str(size)
        target = ET.SubElement(vol_el, "target")
        ET.SubElement(target, "format", {"type": "raw"})
        perms = ET.SubElement(target, "permissions")
        ET.SubElement(perms, "mode").text = oct(mode)[2:].rjust(4, "0")
        existing = self._vol(dest, refresh_kind=kind)
        if existing is not None:
            existing.delete(0)
        vol = self._pools[kind].createXML(ET.tostring(vol_el, encoding="unicode"), 0)
        try:
            with open(source, "rb") as f:
                self._upload(vol, 0, size, counting_reader(f.read, size, progress))
        except BaseException:
            with contextlib.suppress(libvirt.libvirtError):
                vol.delete(0)
            raise
        return str(vol.path())

    # ------------------------------------------------------------------ verified images

    def digest(self, path: str) -> str:
        """The SHA-256 of a file on the host, as the host has it: read from disk when its
        files are this machine's, else downloaded back over a storage stream."""
        h = hashlib.sha256()
        if self.files_local or self.virtual:
            with open(path, "rb") as f:
                hashlib.file_digest(f, lambda: h)
            return h.hexdigest()
        vol = self._vol(path)
        if vol is None:
            raise NotFound(f"no volume {path}")
        size = int(vol.info()[1])
        st = self.conn.newStream(0)
        vol.download(st, 0, size, 0)

        def sink(_st: libvirt.virStream, data: bytes, _o: object) -> int:
            h.update(data)
            return len(data)

        st.recvAll(sink, None)
        st.finish()
        return h.hexdigest()

    def verified_digest(self, kind: str, name: str) -> str | None:
        """The digest recorded when ``name`` was last put and verified; None when it was
        never verified (or the marker is unreadable)."""
        marker = self.path(kind, name + DIGEST_SUFFIX)
        try:
            text = self.read_range(marker, 0, 128).decode("ascii", "replace").strip()
        except NotFound:
            return None
        return text if len(text) == 64 and all(c in "0123456789abcdef" for c in text) else None

    def put_verified(
        self,
        kind: str,
        name: str,
        source: str,
        sha256: str,
        *,
        mode: int = 0o600,
        progress: ByteProgress | None = None,
    ) -> str:
        """`put_file`, then read the copy back and check it against ``sha256``; only then is
        a marker (`<name>.sha256`) written, so a half-done or corrupt upload is never taken
        for the image. A mismatch removes the copy and fails naming both digests."""
        marker = self.path(kind, name + DIGEST_SUFFIX)
        self.delete(marker)  # no marker while the image is being replaced
        dest = self.put_file(kind, name, source, mode=mode, progress=progress)
        got = self.digest(dest)
        if got != sha256:
            self.delete(dest)
            raise FleetError(
                f"{name}: the copy on the host has sha256 {got}, expected {sha256}; removed"
            )
        self.mark_verified(kind, name, sha256)
        return dest

    def mark_verified(self, kind: str, name: str, sha256: str) -> None:
        """Record that ``name`` was read back with ``sha256`` (its marker volume)."""
        with tempfile.NamedTemporaryFile("w", suffix=DIGEST_SUFFIX) as f:
            f.write(sha256 + "\n")
            f.flush()
            self.put_file(kind, name + DIGEST_SUFFIX, f.name, mode=0o644)

    def _virtual_volume(self, kind: str, name: str, size: int, backing: str | None = None) -> None:
        el = ET.Element("volume")
        ET.SubElement(el, "name").text = name
        ET.SubElement(el, "capacity", {"unit": "bytes"}).text = str(size)
        if backing:
            bs = ET.SubElement(el, "backingStore")
            ET.SubElement(bs, "path").text = backing
        with contextlib.suppress(libvirt.libvirtError):
            self._pools[kind].storageVolLookupByName(name).delete(0)
        self._pools[kind].createXML(ET.tostring(el, encoding="unicode"), 0)

    def _upload(
        self, vol: libvirt.virStorageVol, offset: int, length: int, read: Callable[[int], bytes]
    ) -> None:
        st = self.conn.newStream(0)
        vol.upload(st, offset, length, 0)
        try:
            st.sendAll(lambda _st, n, _o: read(min(n, _CHUNK)), None)
            st.finish()
        except BaseException:
            with contextlib.suppress(libvirt.libvirtError):
                st.abort()
            raise

    def read_range(self, path: str, offset: int, length: int | None) -> bytes:
        if self.files_local or self.virtual:
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    return f.read() if length is None else f.read(length)
            except FileNotFoundError as e:
                raise NotFound(f"no file {path}") from e
        vol = self._vol(path)
        if vol is None:
            raise NotFound(f"no volume {path}")
        size = int(vol.info()[1])
        if offset >= size:
            return b""
        want = size - offset if length is None else min(length, size - offset)
        st = self.conn.newStream(0)
        vol.download(st, offset, want, 0)
        buf = bytearray()

        def sink(_st: libvirt.virStream, data: bytes, _o: object) -> int:
            buf.extend(data)
            return len(data)

        st.recvAll(sink, None)
        st.finish()
        return bytes(buf)

    def write_at(self, path: str, offset: int, data: bytes) -> None:
        if self.files_local or self.virtual:
            with open(path, "r+b") as f:
                f.seek(offset)
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            return
        vol = self._vol(path)
        if vol is None:
            raise NotFound(f"no volume {path}")
        view = memoryview(data)
        pos = 0

        def read(n: int) -> bytes:
            nonlocal pos
            chunk = bytes(view[pos : pos + n])
            pos += len(chunk)
            return chunk

        self._upload(vol, offset, len(data), read)

    def write_whole(self, path: str, data: bytes) -> None:
        """Replace a small file (test-driver save images)."""
        tmp = path + ".part"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    def copy(self, src: str, kind: str, name: str) -> str:
        """A byte copy of a host file (a qcow2 keeps its backing reference)."""
        dest = self.path(kind, name)
        if self.files_local and os.path.exists(src):
            tmp = dest + ".part"
            shutil.copyfile(src, tmp)
            os.chmod(tmp, 0o600)
            os.replace(tmp, dest)
            return dest
        svol = self._vol(src)
        if svol is None:
            raise NotFound(f"no volume {src}")
        if self.virtual:  # the test driver's volumes have no content to copy
            self._virtual_volume(kind, name, int(svol.info()[1]), self.backing_of(src))
            return dest
        data = self.read_range(src, 0, None)
        vol_el = ET.Element("volume")
        ET.SubElement(vol_el, "name").text = name
        ET.SubElement(vol_el, "capacity", {"unit": "bytes"}).text = str(len(data))
        ET.SubElement(ET.SubElement(vol_el, "target"), "format", {"type": "raw"})
        vol = self._pools[kind].createXML(ET.tostring(vol_el, encoding="unicode"), 0)
        self.write_at(str(vol.path()), 0, data)
        return str(vol.path())

    def delete(self, path: str | None) -> bool:
        """Remove a file/volume; False when it was already gone (idempotent)."""
        if not path:
            return False
        removed = False
        vol = None
        try:
            vol = self.conn.storageVolLookupByPath(path)
        except libvirt.libvirtError as e:
            if not _no_such(e):
                raise
        if vol is not None:
            try:
                vol.delete(0)
                removed = True
            except libvirt.libvirtError as e:
                if not _no_such(e):
                    raise
        if (self.files_local or self.virtual) and os.path.lexists(path):
            os.unlink(path)
            removed = True
        elif not removed and not (self.files_local or self.virtual):
            vol = self._vol(path)
            if vol is not None:
                vol.delete(0)
                removed = True
        return removed

    def list_names(self, kind: str) -> list[str]:
        names: set[str] = set()
        if self.files_local or self.virtual:
            with contextlib.suppress(FileNotFoundError):
                names.update(n for n in os.listdir(self.dirs[kind]) if not n.endswith(".part"))
        if not self.files_local or self.virtual:  # the test driver keeps volumes virtual
            pool = self._pools[kind]
            with contextlib.suppress(libvirt.libvirtError):
                pool.refresh(0)
            names.update(pool.listVolumes())
        return sorted(names)

    def backing_of(self, path: str) -> str | None:
        """The backing file of a qcow2 image on this host, or None."""
        if self.files_local and not self.virtual:
            return qcow2_backing(path)
        vol = self._vol(path)
        if vol is None:
            return None
        try:
            root = ET.fromstring(vol.XMLDesc(0))
        except libvirt.libvirtError as e:
            if _no_such(e):
                return None
            raise
        return root.findtext("backingStore/path") or None

    def collect_frozen_disks(self, busy: Collection[str] = ()) -> list[str]:
        """Remove the frozen disks of deleted states (a ``.qcow2`` in ``states/`` without its
        ``.save``) that no image on this host is backed by any more, chains included (a frozen
        disk of a clone's state keeps its parent's). ``busy``: states being captured now.
        Returns the names removed."""
        removed: list[str] = []
        while True:
            names = set(self.list_names("states"))
            orphans = {
                n: self.path("states", n)
                for n in names
                if n.endswith(".qcow2")
                and n[: -len(".qcow2")] + ".save" not in names
                and n[: -len(".qcow2")] not in busy
            }
            if not orphans:
                return removed
            used = {
                self.backing_of(self.path(kind, n))
                for kind in ("instances", "states")
                for n in self.list_names(kind)
                if n.endswith(".qcow2")
            }
            free = [n for n, path in orphans.items() if path not in used]
            gone = [n for n in free if self.delete(self.path("states", n))]
            if not gone:
                return removed
            removed.extend(gone)

    def remove_instance_files(self, record: InstanceRecord) -> list[str]:
        """The instance's overlay, seeds and serial logs (and virtlogd's rotated copies);
        returns what was removed."""
        removed: list[str] = []
        paths: list[str] = [record.overlay, record.seed or "", record.serial_log]
        prefix = record.domain + "."
        paths += [
            self.path("instances", n) for n in self.list_names("instances") if n.startswith(prefix)
        ]
        for p in dict.fromkeys(paths):
            if p and self.delete(p):
                removed.append(p)
        return removed

    def sweep_orphans(self, keep: Collection[str], busy_states: Collection[str]) -> list[str]:
        """Remove the files in ``instances/`` of fleet domains not named in ``keep``, and
        frozen disks of deleted or half-written states once nothing is backed by them."""
        removed = []
        for n in self.list_names("instances"):
            owner = n.split(".", 1)[0]
            if not owner.startswith(DOMAIN_PREFIX) or owner in keep:
                continue
            if self.delete(self.path("instances", n)):
                removed.append(n)
        removed.extend(self.collect_frozen_disks(busy_states))
        return removed

    # ------------------------------------------------------------------ save images

    def read_saved(self, path: str) -> save_images.SaveHeader:
        first = self.read_range(path, 0, save_images.QEMU_HEAD_LEN)
        total = save_images.prefix_length(first)
        return save_images.parse(self.read_range(path, 0, total))

    def write_saved(self, path: str, header: save_images.SaveHeader, xml: str) -> None:
        data = save_images.rebuild(header, xml)
        if header.kind == "test":
            self.write_whole(path, data)
        else:
            self.write_at(path, 0, data)

    def clone_snapshot_disk(self, src: str, snapshot: str, base: str, dest: str) -> None:
        """``dest`` = overlay on ``base`` holding ``src``'s disk at ``snapshot`` (local files:
        ``qemu-img convert -U -l snapshot.name=…``)."""
        argv = [
            "qemu-img",
            "convert",
            "-U",
            "-q",
            "-f",
            "qcow2",
            "-O",
            "qcow2",
            "-l",
            f"snapshot.name={snapshot}",
            "-F",
            "qcow2",
            "-B",
            base,
            src,
            dest,
        ]
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            if os.path.exists(dest):
                os.unlink(dest)
            raise FleetError(f"qemu-img convert failed: {proc.stderr.strip()}", stage="disk")
        os.chmod(dest, 0o600)
