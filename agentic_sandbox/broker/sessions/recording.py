"""Session recordings in asciicast v2 (the asciinema format), one file per session.

`<data_dir>/recordings/<session_id>.cast`: a JSON header line, then `[time, code, data]` events:
`o` output, `i` input (optional, off by default), `r` resize (`COLSxROWS`), `m` markers (a gap
or truncation). Output is decoded incrementally as UTF-8 (a character split across chunks is not
mangled). Writes are buffered and flushed by the hub a few times a second.

Crash safety: after each flush a sidecar file `<id>.cast.ckpt` records (file size, output
offset fully written). After a server crash the recording is cut back to the last checkpoint and
continues from that output offset, so bytes the agent resends are recorded exactly once.

Files are never truncated or replaced on creation: a new recording and its checkpoint are
created exclusively (an existing file, whoever made it, is an error, not overwritten), and no
file is opened through a symlink.
"""

from __future__ import annotations

import codecs
import json
import json.encoder
import logging
import os
import struct
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_CKPT = struct.Struct(">QQ")
BUFFER_BYTES = 256 * 1024
BATCH_SECONDS = 0.02  # output chunks closer than this to a batch's first one join its event
BATCH_BYTES = 64 * 1024  # a batch closes at this size (larger buffers come from mmap: page faults)
_c_encode = json.encoder.encode_basestring  # json.dumps's C encoder (ensure_ascii=False)
_SPECIAL = bytes(range(32)) + b'"\\'  # the characters a JSON string escapes
_NOT_SPECIAL = bytes(b for b in range(256) if b not in _SPECIAL)
_ESCAPES = {c: _c_encode(chr(c))[1:-1].encode() for c in _SPECIAL}


def encode_string(text: str) -> bytes:
    """`text` as a JSON string literal, UTF-8: the bytes `json.dumps(text, ensure_ascii=False)`
    makes. ASCII text with few characters to escape (plain output, log lines) is escaped in a
    few whole-buffer passes (`bytes.translate` finds which occur, `bytes.replace` each), two to
    four times faster than the C encoder's per-character loop; anything else goes to it."""
    if text.isascii():
        raw = text.encode()
        if raw.count(b"\n") * 16 <= len(raw):  # dense lines (`yes`) are the encoder's
            special = raw.translate(None, _NOT_SPECIAL)
            if len(special) * 16 <= len(raw):
                present = set(special)
                if 92 in present:  # the backslash first: the other escapes add backslashes
                    raw = raw.replace(b"\\", b"\\\\")
                    present.discard(92)
                for c in present:
                    raw = raw.replace(bytes((c,)), _ESCAPES[c])
                return b'"' + raw + b'"'
    return _c_encode(text).encode()


class Recording:
    def __init__(
        self,
        path: Path,
        *,
        started_wall: float,
        max_bytes: int,
        record_input: bool,
        offset: int = 0,
        new: bool = False,
    ) -> None:
        self.path = path
        self.started_wall = started_wall
        self.max_bytes = max_bytes
        self.record_input = record_input
        self.offset = offset  # next output offset to record
        self.truncated = False
        self.closed = False
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._batch: list[bytes] = []  # output chunks not yet written as an event
        self._batch_bytes = 0
        self._batch_time = 0.0  # wall time of the batch's first chunk
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        self._file = os.fdopen(fd, "ab", buffering=BUFFER_BYTES)
        ckpt_flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        if new:
            ckpt_flags |= os.O_CREAT | os.O_EXCL
        try:
            self._ckpt_fd = os.open(str(path) + ".ckpt", ckpt_flags, 0o600)
        except OSError:
            self._file.close()
            raise
        self._dirty = False

    # ---- creation ------------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        path: Path,
        *,
        cols: int,
        rows: int,
        title: str,
        command: list[str] | None,
        started_wall: float,
        max_bytes: int,
        record_input: bool,
    ) -> Recording:
        """A new recording at `path`; `FileExistsError` when something is there already."""
        header: dict[str, Any] = {
            "version": 2,
            "width": cols,
            "height": rows,
            "timestamp": int(started_wall),
            "env": {"TERM": "xterm-256color", "SHELL": (command or ["/bin/sh"])[0]},
        }
        if title:
            header["title"] = title
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(header).encode() + b"\n")
        try:
            rec = cls(
                path,
                started_wall=started_wall,
                max_bytes=max_bytes,
                record_input=record_input,
                new=True,
            )
        except OSError:
            path.unlink(missing_ok=True)  # ours: created above
            raise
        rec.checkpoint()
        return rec

    @classmethod
    def resume(
        cls, path: Path, *, started_wall: float, max_bytes: int, record_input: bool
    ) -> Recording | None:
        """Reopen after a restart, cut back to the last checkpoint; None when unusable."""
        try:
            fd = os.open(str(path) + ".ckpt", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                size, offset = _CKPT.unpack(f.read(_CKPT.size))
        except (OSError, struct.error):
            return None
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
            return cls(
                path,
                started_wall=started_wall,
                max_bytes=max_bytes,
                record_input=record_input,
                offset=offset,
            )
        except OSError:
            return None

    # ---- events -------------------------------------------------------------------------------
    def _line(self, wall: float, code: str, encoded: bytes) -> None:
        """Write one event; `encoded` is its data as a JSON string literal."""
        t = round(max(0.0, wall - self.started_wall), 6)
        line = b"".join((f'[{t!r}, "{code}", '.encode(), encoded, b"]\n"))
        if self.max_bytes and self._file.tell() + len(line) > self.max_bytes:
            self.truncated = True
            self._batch.clear()
            self._batch_bytes = 0
            marker = json.dumps([t, "m", "recording truncated: size limit reached"]).encode()
            self._file.write(marker + b"\n")
            log.warning("recording %s reached its size limit", self.path.name)
            return
        self._file.write(line)
        self._dirty = True

    def _close_batch(self) -> None:
        """Write the waiting output chunks as one `o` event."""
        if not self._batch:
            return
        chunks = self._batch
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._batch = []
        self._batch_bytes = 0
        if self.closed or self.truncated:
            return
        text = self._decoder.decode(data)
        if text:
            self._line(self._batch_time, "o", encode_string(text))

    def _event(self, code: str, data: str) -> None:
        self._close_batch()  # events stay in the order they happened
        if self.closed or self.truncated:
            return
        self._line(time.time(), code, encode_string(data))

    def output(self, offset: int, data: bytes) -> None:
        if self.closed:
            return
        end = offset + len(data)
        if end <= self.offset:
            return  # already recorded (resent after a reconnect)
        if offset < self.offset:
            data = data[self.offset - offset :]
            offset = self.offset
        elif offset > self.offset:
            self._close_batch()
            self._decoder.reset()
            self._event("m", f"gap: output {self.offset}..{offset} was not received")
        self.offset = end
        if self.truncated:
            return
        now = time.time()
        if self._batch and (
            now - self._batch_time >= BATCH_SECONDS or self._batch_bytes >= BATCH_BYTES
        ):
            self._close_batch()
        if not self._batch:
            self._batch_time = now
        self._batch.append(data)
        self._batch_bytes += len(data)

    def input(self, data: bytes) -> None:
        if self.record_input:
            self._event("i", data.decode("utf-8", "replace"))

    def resize(self, cols: int, rows: int) -> None:
        self._event("r", f"{cols}x{rows}")

    # ---- durability ---------------------------------------------------------------------------
    def checkpoint(self) -> None:
        pending = len(self._decoder.getstate()[0]) + self._batch_bytes
        os.pwrite(self._ckpt_fd, _CKPT.pack(self._file.tell(), self.offset - pending), 0)

    def flush(self) -> None:
        if self.closed:
            return
        self._close_batch()
        if not self._dirty:
            return
        self._dirty = False
        self._file.flush()
        self.checkpoint()

    def close(self) -> None:
        if self.closed:
            return
        self._close_batch()
        tail = self._decoder.decode(b"", final=True)
        if tail:
            self._event("o", tail)
        self._dirty = True
        self.flush()
        self.closed = True
        self._file.close()
        os.close(self._ckpt_fd)
