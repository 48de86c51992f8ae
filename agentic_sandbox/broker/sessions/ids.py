"""Session ids as the server hands them out, checked wherever one comes back from outside.

A session id is a UUID in its canonical form, as `str(uuid.uuid4())` writes it: 36 characters,
lower-case hex and hyphens. An id that an agent sends (in its inventory, or in an `opened`,
`output` or `exit` message) is checked against that form before it is looked up, stored, logged
at length or turned into a file name. File names are built from checked ids only, and the path
is checked to resolve to a file directly inside its directory (a symlink planted there does not
lead elsewhere).
"""

from __future__ import annotations

import uuid
from pathlib import Path

UUID_CHARS = 36


class UnsafePath(ValueError):
    """A file name that is not built from a checked id, or that leads out of its directory."""


def is_session_id(value: str) -> bool:
    """True for a UUID in canonical form (what `str(uuid.uuid4())` gives), nothing else."""
    if len(value) != UUID_CHARS:  # cheap first: no parsing of huge strings
        return False
    try:
        return str(uuid.UUID(value)) == value
    except ValueError:
        return False


def shown(value: str, limit: int = 64) -> str:
    """An untrusted id as a log line may show it: cut, repr-quoted (no control characters)."""
    text = value[:limit]
    return repr(text) + ("…" if len(value) > limit else "")


def session_file(directory: Path, session_id: str, suffix: str) -> Path:
    """`directory / (session_id + suffix)` for a checked session id, resolving inside
    `directory`; raises `UnsafePath` otherwise."""
    if not is_session_id(session_id):
        raise UnsafePath(f"not a session id: {shown(session_id)}")
    path = directory / f"{session_id}{suffix}"
    if path.resolve().parent != directory.resolve():
        raise UnsafePath(f"{path} does not stay inside {directory}")
    return path
