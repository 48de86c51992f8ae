"""Who may see and who may control a session.

Admins: every session. Others: sessions they own, or that are shared with them (a `shares` row
for the session or its instance; `access="control"` lets an operator take control). Anything
else is invisible (404). A2A API keys are for the A2A surface, not for sessions. Viewers observe
only, whatever they own.
"""

from __future__ import annotations

from sqlalchemy import or_, select

from agentic_sandbox.broker.auth.principal import Principal, Role
from agentic_sandbox.broker.http.problems import ProblemError, not_found
from agentic_sandbox.broker.store import Database
from agentic_sandbox.broker.store import models as m


async def shared_access(
    db: Database, who: Principal, session_id: str, instance_id: str
) -> str | None:
    async with db.session() as s:
        rows = (
            await s.scalars(
                select(m.Share.access).where(
                    m.Share.subject == who.subject,
                    or_(
                        (m.Share.object_type == "session") & (m.Share.object_id == session_id),
                        (m.Share.object_type == "instance") & (m.Share.object_id == instance_id),
                    ),
                )
            )
        ).all()
    if not rows:
        return None
    return "control" if "control" in rows else "read"


async def session_access(
    db: Database, who: Principal, *, session_id: str, owner: str, instance_id: str
) -> tuple[bool, bool]:
    """(may see, may control); raises a 403 for API keys."""
    if who.kind == "apikey":
        raise ProblemError(
            403, "A2A API keys cannot use the admin session routes", code="forbidden-key"
        )
    if who.is_admin or who.subject == owner:
        return True, who.role.allows(Role.operator)
    shared = await shared_access(db, who, session_id, instance_id)
    if shared is None:
        return False, False
    return True, shared == "control" and who.role.allows(Role.operator)


async def require_visible(
    db: Database, who: Principal, *, session_id: str, owner: str, instance_id: str
) -> bool:
    """Raise 404 unless visible; returns whether the caller may control it."""
    visible, control = await session_access(
        db, who, session_id=session_id, owner=owner, instance_id=instance_id
    )
    if not visible:
        raise not_found("session", session_id)
    return control
