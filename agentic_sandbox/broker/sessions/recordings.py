"""Where session recordings live: `<data_dir>/recordings/<session id>.cast` (mode 0700 folder).

A file name is always derived from a checked session id and must resolve directly inside the
folder (`ids.session_file`); a row's stored `recording_path` only says that the session is
recorded and is never opened, so a row cannot point the server at another file. New files are
created exclusively and never through a symlink (`Recording.create`): an existing file is never
truncated. The format itself is `recording.py`.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from agentic_sandbox.broker.config import Settings
from agentic_sandbox.broker.sessions.ids import UnsafePath, session_file, shown
from agentic_sandbox.broker.sessions.recording import Recording
from agentic_sandbox.broker.store import models as m

log = logging.getLogger(__name__)

SUFFIX = ".cast"


class RecordingStore:
    def __init__(self, settings: Settings) -> None:
        self.directory = settings.data_dir / "recordings"
        self.enabled = settings.session_recording
        self._max_bytes = settings.session_recording_max_bytes
        self._record_input = settings.session_recording_input

    def prepare(self) -> None:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.directory.chmod(0o700)

    def file(self, session_id: str) -> Path | None:
        """The recording file of a session, for a well-formed id and resolving inside the
        recordings directory; None otherwise."""
        try:
            return session_file(self.directory, session_id, SUFFIX)
        except UnsafePath:
            return None

    def create(
        self,
        session_id: str,
        *,
        cols: int,
        rows: int,
        title: str,
        command: list[str] | None,
        started_wall: float,
    ) -> Recording:
        """A new recording for a session the server made (raises `UnsafePath` for an id it did
        not, `FileExistsError` when the file exists)."""
        return Recording.create(
            session_file(self.directory, session_id, SUFFIX),
            cols=cols,
            rows=rows,
            title=title,
            command=command,
            started_wall=started_wall,
            max_bytes=self._max_bytes,
            record_input=self._record_input,
        )

    def resume(self, row: m.Session) -> Recording | None:
        """The recording of a stored session, continued from its checkpoint (None when the
        session is not recorded, recording is off, or the row's id is not one the server
        makes)."""
        if not (row.recording_path and self.enabled):
            return None
        path = self.file(row.id)
        if path is None:
            log.warning(
                "session %s: not a session id the server makes; its recording is not resumed",
                shown(row.id),
            )
            return None
        return Recording.resume(
            path,
            started_wall=row.created_at.timestamp(),
            max_bytes=self._max_bytes,
            record_input=self._record_input,
        )

    def create_adopted(self, row: m.Session, offset: int) -> str | None:
        """A new recording for an adopted session, starting at `offset` (what came before is
        not on this server); its path, or None. Never an existing file: when one is there,
        whoever made it, it is left alone and the session is not recorded."""
        path = self.file(row.id)
        if path is None:
            return None
        try:
            rec = self.create(
                row.id,
                cols=row.cols,
                rows=row.rows,
                title="adopted",
                command=None,
                started_wall=row.created_at.timestamp(),
            )
        except FileExistsError:
            log.warning(
                "session %s: a recording with its name exists already; it is left as it is and "
                "the adopted session is not recorded",
                row.id,
                extra={"session_id": row.id},
            )
            return None
        except OSError:
            log.exception("creating the recording of adopted session %s failed", row.id)
            return None
        rec.offset = offset
        rec.close()
        return str(path)

    @staticmethod
    def discard(path: Path) -> None:
        """Remove a recording made for a row that was never stored (and its checkpoint)."""
        for p in (path, Path(str(path) + ".ckpt")):
            with contextlib.suppress(OSError):
                p.unlink()
