"""PTY sessions: create, list, get, kill, signal, screen, recording, and attach."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from agentic_sandbox.sdk.attach import Attachment, ControlHandler, Role
from agentic_sandbox.sdk.models import Screen, Session
from agentic_sandbox.sdk.operations import ADMIN, Resource

Signal = Literal["INT", "TERM", "KILL", "HUP"]


class AsyncSessions(Resource):
    async def create(
        self,
        instance_id: str,
        command: Sequence[str] | None = None,
        *,
        name: str = "",
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        cols: int = 80,
        rows: int = 24,
    ) -> Session:
        """A new PTY on the instance's agent: `command` (argv), or a login shell."""
        body: dict[str, object] = {
            "instance_id": instance_id,
            "name": name,
            "cols": cols,
            "rows": rows,
        }
        if command is not None:
            body["command"] = list(command)
        if env:
            body["env"] = dict(env)
        if cwd is not None:
            body["cwd"] = cwd
        if user is not None:
            body["user"] = user
        return await self._t.model(Session, "POST", f"{ADMIN}/sessions", json_body=body)

    async def list(
        self,
        *,
        instance_id: str | None = None,
        state: str | None = None,
        task_id: str | None = None,
        limit: int | None = None,
    ) -> list[Session]:
        """Newest first."""
        params = {"instance_id": instance_id, "state": state, "task_id": task_id, "limit": limit}
        return await self._t.items(Session, f"{ADMIN}/sessions", params)

    async def get(self, session_id: str) -> Session:
        return await self._t.model(Session, "GET", f"{ADMIN}/sessions/{session_id}")

    async def kill(self, session_id: str) -> Session:
        """HUP to its process group, then KILL after a grace period."""
        return await self._t.model(Session, "POST", f"{ADMIN}/sessions/{session_id}/kill")

    async def signal(self, session_id: str, signal: Signal) -> Session:
        """A signal to the session's foreground process group."""
        return await self._t.model(
            Session,
            "POST",
            f"{ADMIN}/sessions/{session_id}/signal",
            json_body={"signal": signal},
        )

    async def screen(self, session_id: str, *, scrollback: int | None = None) -> Screen:
        """The current screen (rows, cols, cursor, text) and a scrollback tail."""
        return await self._t.model(
            Screen,
            "GET",
            f"{ADMIN}/sessions/{session_id}/screen",
            params={"scrollback": scrollback},
        )

    async def recording(self, session_id: str) -> bytes:
        """The session's recording, an asciicast v2 file."""
        data: bytes = await self._t.request(
            "GET", f"{ADMIN}/sessions/{session_id}/recording", raw=True
        )
        return data

    def attach(
        self,
        session_id: str,
        *,
        role: Role = "control",
        from_offset: int | None = None,
        force: bool = False,
        on_control: ControlHandler | None = None,
        reconnect_within: float = 60.0,
    ) -> Attachment:
        """The session's terminal (use with `async with`, iterate for `(offset, bytes)`).
        `from_offset` resumes at that byte of the output (0: from the start, as far as the
        server still holds it); without it the server sends the current screen first."""
        return Attachment(
            self._t,
            session_id,
            role=role,
            from_offset=from_offset,
            force=force,
            on_control=on_control,
            reconnect_within=reconnect_within,
        )
