"""An agent upgrade in a real `isolated` guest: a rollout sends a bundle over the agent link
(the guest's one forward), the guest's session keeper starts a worker on it, the worker links
and hears the server, and a session started before goes on, writable, through the same shell.

Last in the package (file order): the guest runs the new bundle afterwards.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from tests.support.ptyclient import PtyClient
from tests.support.server import ServerProcess
from tests.support.sessions import create_session
from tests.support.upgrades import repack, roll_out, upload

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]


async def test_a_rollout_upgrades_the_guest_agent_and_keeps_its_session(
    server: ServerProcess, guest: str
) -> None:
    before = server.ok("GET", f"/api/v2/admin/agents/{guest}")
    assert len(before["agent_bundle"]) == 64  # what the provision shipped
    own = server.ok("GET", "/api/v2/admin/agent-bundles")["items"][0]
    assert own["builtin"] and own["digest"] == before["agent_bundle"]
    status, bundle = upload(server, repack("9.9.9+guest-e2e"))
    assert status == 201, bundle
    sid = create_session(server, guest, ["sh", "-c", "while read l; do echo got:$l:$$:end; done"])
    async with await PtyClient.connect(
        server.ws_url, sid, server.admin_token, role="control", from_offset=0
    ) as ctl:
        await ctl.send_input(b"before\n")
        await ctl.wait_output(b":end", timeout=60)
        found = re.search(rb"got:before:(\d+):end", bytes(ctl.data))
        assert found is not None, bytes(ctl.data)
        shell = found.group(1)
        op = await asyncio.to_thread(
            roll_out,
            server,
            {"bundle": bundle["digest"], "instances": [guest], "trial_seconds": 300},
            timeout=600,
        )
        assert op["state"] == "succeeded", op
        (outcome,) = op["result"]["instances"]
        assert outcome["state"] == "upgraded" and outcome["sessions_kept"] == 1, outcome
        print(f"guest agent upgraded in {outcome['seconds']} s")
        await ctl.send_input(b"after\n")
        await ctl.wait_output(b"got:after:" + shell + b":end", timeout=60)  # the same shell
    after = server.ok("GET", f"/api/v2/admin/agents/{guest}")
    assert after["agent_version"] == "9.9.9+guest-e2e"
    assert after["agent_bundle"] == bundle["digest"] and after["state"] == "connected"
    status, out = server.api(
        "POST", f"/api/v2/admin/instances/{guest}/exec", {"argv": ["true"]}, timeout=300
    )
    assert status == 200 and out["exit_code"] == 0, out  # the new worker runs execs too
