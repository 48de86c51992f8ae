"""Who may revoke an operator token: a viewer only its own credential, nobody one of a higher
role, and "own" is the credential's identity — never its reusable subject name."""

from __future__ import annotations

from tests.integration.security.conftest import Stack


def credential_id(stack: Stack, token: str) -> str:
    return str(stack.server.ok("GET", "/api/v2/admin/whoami", token=token)["credential_id"])


async def test_a_viewer_named_admin_cannot_revoke_the_admins_token(stack: Stack) -> None:
    server = stack.server
    impostor = server.make_token("admin", "viewer")  # any admin may pick any subject name
    admin_id = stack.token_ids["admin"]
    status, body = server.api("DELETE", f"/api/v2/admin/tokens/{admin_id}", token=impostor)
    assert status == 404 and body["code"] == "token-not-found"
    assert server.api("GET", "/api/v2/admin/whoami")[0] == 200  # the admin token still works
    # It does not even see the admin's token: only its own.
    listing = server.ok("GET", "/api/v2/admin/tokens", token=impostor)
    assert [t["id"] for t in listing["items"]] == [credential_id(stack, impostor)]
    # Its own it may revoke (and then it is gone).
    own = credential_id(stack, impostor)
    assert server.api("DELETE", f"/api/v2/admin/tokens/{own}", token=impostor)[0] == 204
    assert server.api("GET", "/api/v2/admin/whoami", token=impostor)[0] == 401


async def test_an_operator_revokes_only_its_own_credential(stack: Stack) -> None:
    server = stack.server
    first = server.make_token("olga", "operator")
    second = server.make_token("olga", "operator")  # the same subject, another credential
    status, _ = server.api(
        "DELETE", f"/api/v2/admin/tokens/{credential_id(stack, second)}", token=first
    )
    assert status == 404
    assert server.api("GET", "/api/v2/admin/whoami", token=second)[0] == 200
    # An admin revokes any.
    assert server.api("DELETE", f"/api/v2/admin/tokens/{credential_id(stack, second)}")[0] == 204
    assert server.api("GET", "/api/v2/admin/whoami", token=second)[0] == 401
    mine = credential_id(stack, first)
    assert server.api("DELETE", f"/api/v2/admin/tokens/{mine}", token=first)[0] == 204
