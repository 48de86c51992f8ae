"""The live-stream registry: revoking a credential ends exactly its streams, at once."""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest

from agentic_sandbox.broker.auth.principal import Principal, Role
from agentic_sandbox.broker.auth.routes import may_revoke
from agentic_sandbox.broker.auth.streams import LiveStreams, TooManyStreams


def token(cid: str, role: Role = Role.operator, **kw: object) -> Principal:
    return Principal(subject="alice", role=role, kind="token", credential_id=cid, **kw)  # type: ignore[arg-type]


async def test_revoking_a_token_ends_its_streams_and_its_cookies_streams_only() -> None:
    reg = LiveStreams(max_per_credential=10)
    by_token = reg.open(token("t1"), "sse")
    cookie = Principal(
        subject="alice", role=Role.operator, kind="cookie", credential_id="t1", web_session="w1"
    )
    by_cookie = reg.open(cookie, "ws")
    other = reg.open(token("t2"), "ws")
    ended: list[str] = []
    by_cookie.on_revoke(ended.append)  # runs synchronously, inside revoke()
    assert reg.revoke("token:t1", "token revoked") == 2
    assert ended == ["token revoked"]
    assert by_token.revoked.is_set() and by_cookie.revoked.is_set()
    assert not other.revoked.is_set()
    assert reg.count() == 1


async def test_signing_out_ends_that_cookies_streams_not_the_tokens() -> None:
    reg = LiveStreams(max_per_credential=10)
    bearer = reg.open(token("t1"), "sse")
    cookie = reg.open(
        Principal(
            subject="alice", role=Role.operator, kind="cookie", credential_id="t1", web_session="w1"
        ),
        "ws",
    )
    assert reg.revoke("web:w1", "signed out") == 1
    assert cookie.revoked.is_set() and not bearer.revoked.is_set()


async def test_a_callback_added_after_revocation_runs_at_once() -> None:
    reg = LiveStreams(max_per_credential=10)
    lease = reg.open(token("t1"), "ws")
    reg.revoke("token:t1", "token revoked")
    seen: list[str] = []
    lease.on_revoke(seen.append)
    assert seen == ["token revoked"]


async def test_streams_per_credential_are_bounded_and_released() -> None:
    reg = LiveStreams(max_per_credential=2)
    a = reg.open(token("t1"), "sse")
    reg.open(token("t1"), "sse")
    with pytest.raises(TooManyStreams):
        reg.open(token("t1"), "sse")
    reg.open(token("t2"), "sse")  # another credential has its own allowance
    a.release()
    reg.open(token("t1"), "sse")
    assert reg.count("token:t1") == 2


async def test_an_expiring_credential_ends_its_streams_when_it_expires() -> None:
    reg = LiveStreams(max_per_credential=10)
    soon = dt.datetime.now(dt.UTC) + dt.timedelta(milliseconds=50)
    lease = reg.open(token("t1", expires_at=soon), "sse")
    await asyncio.wait_for(lease.revoked.wait(), 5)
    assert lease.reason == "credential expired" and reg.count() == 0


def test_revocation_rules_compare_credential_ids_and_roles() -> None:
    viewer_named_admin = Principal(
        subject="admin", role=Role.viewer, kind="token", credential_id="v1"
    )
    assert may_revoke(viewer_named_admin, "v1", Role.viewer)  # its own
    assert not may_revoke(viewer_named_admin, "boot", Role.admin)  # same subject, not its own
    operator = token("o1")
    assert not may_revoke(operator, "o2", Role.operator)  # another credential
    assert not may_revoke(operator, "o1", Role.admin)  # never a higher role
    admin = Principal(subject="root", role=Role.admin, kind="token", credential_id="a1")
    assert may_revoke(admin, "boot", Role.admin) and may_revoke(admin, "v1", Role.viewer)
