"""Waiting for a condition, never for a time: poll it until it holds or a deadline passes.

`wait_until` for blocking tests, `until` for async ones. The deadline only bounds a hung run;
a test asserts the state once the condition holds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_until(check: Callable[[], object], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"still not true after {timeout}s: {what}")
        time.sleep(0.05)


async def until(pred: Callable[[], object], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.01)
