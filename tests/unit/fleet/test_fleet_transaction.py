"""The one undo helper: steps undone newest first, the original error never masked."""

from __future__ import annotations

import asyncio

import pytest

from agentic_sandbox.fleet import FleetError, NotFound
from agentic_sandbox.fleet.transaction import Transaction


async def test_a_failing_step_undoes_what_was_done_newest_first() -> None:
    undone: list[str] = []
    failing: list[bool] = []

    async def undo_async(what: str) -> None:
        undone.append(what)

    with pytest.raises(NotFound) as caught:
        async with Transaction(
            "make x", stage="one", on_failure=lambda: failing.append(True)
        ) as tx:
            tx.on_undo("a", lambda: undone.append("a"))  # a plain function
            tx.stage = "two"
            tx.on_undo("b", lambda: undo_async("b"))  # or one returning an awaitable
            raise NotFound("no such thing")
    assert undone == ["b", "a"]
    assert failing == [True]
    assert caught.value.stage == "two"  # a fleet error keeps its type, gets the stage


async def test_a_failing_undo_step_never_masks_the_error_and_the_rest_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    undone: list[str] = []

    def broken() -> None:
        raise RuntimeError("undo broke")

    with pytest.raises(FleetError) as caught:
        async with Transaction("make x", stage="disk") as tx:
            tx.on_undo("first", lambda: undone.append("first"))
            tx.on_undo("broken", broken)
            raise OSError("disk full")
    assert undone == ["first"]
    assert caught.value.stage == "disk"
    assert "make x failed at disk: disk full" in str(caught.value)
    assert isinstance(caught.value.__cause__, OSError)  # the original, not the undo's
    assert "clean-up step 'broken' failed" in caplog.text


async def test_without_a_description_errors_pass_as_they_are() -> None:
    undone: list[str] = []
    with pytest.raises(OSError):
        async with Transaction() as tx:
            tx.on_undo("a", lambda: undone.append("a"))
            raise OSError("as it is")
    assert undone == ["a"]


async def test_cancellation_is_undone_and_passes_unwrapped() -> None:
    undone: list[str] = []
    started = asyncio.Event()

    async def op() -> None:
        async with Transaction("make x", stage="booting") as tx:
            tx.on_undo("a", lambda: undone.append("a"))
            started.set()
            await asyncio.sleep(60)

    task = asyncio.create_task(op())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert undone == ["a"]


async def test_success_undoes_nothing() -> None:
    undone: list[str] = []
    async with Transaction("make x") as tx:
        tx.on_undo("a", lambda: undone.append("a"))
    await tx.rollback()  # committed: nothing is left to take back
    assert undone == []
