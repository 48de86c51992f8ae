"""Session states (the `state` column of a session row, and of every session the hub holds).

    starting -> running | exited | failed | lost   (the agent answers the open, or does not)
    running  -> killing | exited | failed | lost
    killing  -> exited | failed | lost             (a kill is pending: HUP, then KILL)
    exited, failed, lost: ended, never change

`lost`: the session vanished (its agent no longer has it, its instance ended, or its reports
were impossible). Transitions happen in `lifecycle.py` only.
"""

from __future__ import annotations

from enum import StrEnum


class SessionState(StrEnum):
    starting = "starting"
    running = "running"
    killing = "killing"
    exited = "exited"
    failed = "failed"
    lost = "lost"

    @property
    def ended(self) -> bool:
        return self in ENDED


ENDED = frozenset({SessionState.exited, SessionState.failed, SessionState.lost})
LIVE = (SessionState.starting, SessionState.running, SessionState.killing)
