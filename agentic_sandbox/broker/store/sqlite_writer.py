"""SQLite's one writer at a time, queued in this process instead of in SQLite's busy handler.

SQLite lets one connection write at a time, and the engine's pool hands out several
connections, so two transactions of this process often want to write at once: the event and
audit batch writers, a session's row, a task's transition. The second one's first INSERT,
UPDATE or DELETE used to meet SQLITE_BUSY, and SQLite's busy handler then *sleeps and polls*
(1, 2, 5, 10, 15 … ms steps) rather than waking when the lock frees. Under
`tests/bench/bench_a2a.py` at one client, 1442 of 17 700 driver calls waited like that, their
times in clusters at 1, 3, 8, 18 and 30+ ms (the sums of those steps). With the connections
run on the loop's thread (`sqlite_inline.py`) such a sleep would stall the whole server.

Here a writer waits its turn on a FIFO lock on the loop instead, taken just before its
transaction's first write statement (where `sqlite3` begins the transaction) and released as
soon as the DBAPI commit or rollback has run. An uncontended take is synchronous; the next
writer starts the moment the lock frees, in arrival order; reads never wait (WAL). A writer
that waits longer than `wait_seconds` (the bound of SQLite's busy_timeout) gets "database is
locked", as before. `busy_timeout` still covers writers outside this process.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections import deque
from collections.abc import Callable
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import OperationalError
from sqlalchemy.util import await_

from agentic_sandbox.broker.store.rowcache import READ_ONLY


class SerialWriter:
    """Install on a SQLite engine: `SerialWriter(engine.sync_engine, 5.0)`."""

    def __init__(self, engine: Engine, wait_seconds: float) -> None:
        self.wait_seconds = wait_seconds
        # A FIFO lock whose uncontended take is synchronous (no await, no timer): `_held`,
        # and the writers waiting for their turn, which is handed to the first of them.
        self._held = False
        self._turns: deque[asyncio.Future[None]] = deque()
        self._holder: object | None = None  # the aiosqlite connection that holds the lock
        self._loop: asyncio.AbstractEventLoop | None = None
        #: writes that had to wait for another of this process's writers
        self.waits = 0
        event.listen(engine, "before_cursor_execute", self._before)
        event.listen(engine, "after_cursor_execute", self._after)
        dialect: Any = engine.dialect
        dialect.do_commit = self._ending(dialect.do_commit, always=False)
        dialect.do_rollback = self._ending(dialect.do_rollback, always=True)
        dialect.do_close = self._ending(dialect.do_close, always=True)

    def _before(
        self,
        conn: Connection,
        _cursor: Any,
        statement: str,
        parameters: Any,
        _context: Any,
        _executemany: bool,
    ) -> None:
        driver = conn.connection.driver_connection
        # only statements that cannot write go by; any other waits for its turn (sqlite3
        # begins a write transaction before INSERT, UPDATE, DELETE and REPLACE; DDL and the
        # rest may take the lock on their own)
        if self._holder is driver or READ_ONLY.match(statement):
            return
        if not self._held:
            self._held = True
        else:
            self.waits += 1
            try:
                await_(self._wait_turn())
            except TimeoutError:
                raise OperationalError(
                    statement,
                    parameters,
                    sqlite3.OperationalError(
                        f"database is locked: another writer of this server held it for "
                        f"{self.wait_seconds:g} s"
                    ),
                ) from None
        self._holder = driver
        self._loop = asyncio.get_running_loop()

    async def _wait_turn(self) -> None:
        turn = asyncio.get_running_loop().create_future()
        self._turns.append(turn)
        try:
            async with asyncio.timeout(self.wait_seconds):
                await turn
        except BaseException:
            if turn.done() and not turn.cancelled():  # handed the turn just as it gave up
                self._hand_on()
            else:
                turn.cancel()
            raise

    def _after(
        self,
        conn: Connection,
        _cursor: Any,
        _statement: str,
        _parameters: Any,
        _context: Any,
        _executemany: bool,
    ) -> None:
        # a write outside a transaction (autocommit) is over once it has run
        driver = conn.connection.driver_connection
        if self._holder is driver and not getattr(driver, "in_transaction", True):
            self._release()

    def _ending(self, method: Callable[[Any], None], *, always: bool) -> Callable[[Any], None]:
        def end(dbapi_connection: Any) -> None:
            try:
                method(dbapi_connection)
            finally:
                driver = getattr(dbapi_connection, "driver_connection", None)
                # a failed commit leaves the transaction open: its rollback releases
                mine = self._holder is not None and self._holder is driver
                if mine and (always or not getattr(driver, "in_transaction", False)):
                    self._release()

        return end

    def _release(self) -> None:
        self._holder = None
        loop = self._loop
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is None or running is loop:
            self._hand_on()
        else:  # a connection closed from outside the loop (a garbage-collected one)
            loop.call_soon_threadsafe(self._hand_on)

    def _hand_on(self) -> None:
        """The next waiting writer's turn (the lock stays held), or the lock freed."""
        while self._turns:
            turn = self._turns.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self._held = False
