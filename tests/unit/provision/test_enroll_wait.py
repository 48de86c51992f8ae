"""How long `enrolling` waits: a guest whose console still advances is booting slowly (TCG on a
loaded host), not stuck, so the server's default timeout waits on for it up to a limit; a quiet
console ends the wait; a timeout the caller names is exact."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from agentic_sandbox.fleet import Fleet, Instance, InstanceState
from agentic_sandbox.provision import load_catalog
from agentic_sandbox.provision.pipeline import (
    Enroller,
    Provisioner,
    ProvisionError,
    ProvisionRequest,
)


class Console:
    """A guest console that prints a line at every read while `talking`, then nothing."""

    def __init__(self, talk_for: float) -> None:
        self.until = asyncio.get_running_loop().time() + talk_for

    async def read_serial_log(self, instance_id: str, offset: int = 0) -> bytes:
        return b"[ ok ] booting\n" if asyncio.get_running_loop().time() < self.until else b""

    async def get(self, instance_id: str) -> Any:
        return SimpleNamespace(state=InstanceState.RUNNING, state_reason="")


class AgentAfter:
    """An enroller whose agent enrolls `after` seconds in (never, with None)."""

    def __init__(self, after: float | None) -> None:
        self.after = after

    async def wait_ready(self, instance_id: str, incarnation: str) -> None:
        if self.after is None:
            await asyncio.Event().wait()
        else:
            await asyncio.sleep(self.after)


async def wait(
    tmp: Path, *, talk_for: float, enroll_after: float | None, limit: float | None
) -> None:
    prov = Provisioner(cast(Fleet, Console(talk_for)), tmp)
    prov.console_poll_seconds = 0.01
    prov.console_quiet_seconds = 0.3
    req = ProvisionRequest(
        instance_id="slow-1",
        owner="admin",
        loadout=load_catalog().resolve("minimal"),
        incarnation="inc-1",
        ready_timeout=0.2,
        ready_limit=limit,
    )
    inst = cast(Instance, SimpleNamespace(instance_id="slow-1"))
    await prov._wait_enrolled(req, inst, cast(Enroller, AgentAfter(enroll_after)))


async def test_a_guest_still_booting_at_the_timeout_gets_to_enroll(tmp_path: Path) -> None:
    await wait(tmp_path, talk_for=10, enroll_after=0.6, limit=10)


async def test_a_timeout_the_caller_names_is_exact(tmp_path: Path) -> None:
    with pytest.raises(ProvisionError) as err:
        await wait(tmp_path, talk_for=10, enroll_after=0.6, limit=None)
    assert err.value.stage == "enrolling"
    assert "did not enroll within 0s" in err.value.cause


async def test_a_quiet_console_ends_the_wait_after_the_timeout(tmp_path: Path) -> None:
    with pytest.raises(ProvisionError) as err:
        await wait(tmp_path, talk_for=0.05, enroll_after=None, limit=10)
    assert "console has been quiet" in err.value.cause, err.value.cause


async def test_a_console_that_never_stops_ends_at_the_limit(tmp_path: Path) -> None:
    with pytest.raises(ProvisionError) as err:
        await wait(tmp_path, talk_for=10, enroll_after=None, limit=0.8)
    assert "within 1s" in err.value.cause and "still advancing" in err.value.cause
