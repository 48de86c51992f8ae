"""Who is calling: roles, principals and the ownership rule."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from enum import StrEnum


class Role(StrEnum):
    viewer = "viewer"  # read and observe only
    operator = "operator"  # create and control what it owns
    admin = "admin"  # everything, everyone's

    @property
    def rank(self) -> int:
        return _RANK[self]

    def allows(self, needed: Role) -> bool:
        return self.rank >= needed.rank


_RANK = {Role.viewer: 0, Role.operator: 1, Role.admin: 2}


@dataclass(frozen=True)
class Principal:
    """An authenticated caller.

    `subject` is the owner name objects created by this caller get. `kind` says how it proved
    itself: an operator token (`token`), the dashboard cookie (`cookie`, mutations need CSRF) or
    an agent-bound A2A key (`apikey`, limited to `instance_id` and `scopes`).

    `credential_id` is the token's or key's id (a cookie's is the token it was made from);
    `web_session` is the cookie's own id, so signing out ends only that session's streams.
    `expires_at` is when the credential stops being valid (the earlier of token and cookie).
    """

    subject: str
    role: Role
    kind: str
    credential_id: str
    scopes: frozenset[str] = field(default_factory=frozenset)
    instance_id: str | None = None
    web_session: str | None = None
    expires_at: dt.datetime | None = None

    @property
    def is_admin(self) -> bool:
        return self.role is Role.admin

    def can_see(self, owner: str, shared_with: frozenset[str] = frozenset()) -> bool:
        """Non-admins see only what they own or what is shared with them."""
        return self.is_admin or owner == self.subject or self.subject in shared_with

    @property
    def credential_keys(self) -> tuple[str, ...]:
        """Every credential this caller proved itself with; revoking any one ends its streams."""
        prefix = "apikey" if self.kind == "apikey" else "token"
        keys: tuple[str, ...] = (f"{prefix}:{self.credential_id}",)
        if self.web_session is not None:
            keys += (f"web:{self.web_session}",)
        return keys

    @property
    def actor(self) -> str:
        """The name written into events and the audit log."""
        return f"{self.kind}:{self.subject}"
