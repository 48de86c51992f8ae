"""Read-only views of one table's rows by primary key, kept in memory while nothing wrote
the table.

A route on the hot path (exec, files, ports: one per command or transfer) checks the instance
it names — who owns it, its incarnation — before anything else. Through the ORM and
aiosqlite that read is a transaction of several round trips to the driver's thread (1.1 ms
on an idle server, 2.2 ms under an exec loop, measured): more than the command itself. A view
kept here answers without the database.

Correct only while this process is the table's one writer: SQLite (one server owns its data
directory). On PostgreSQL other nodes write the same rows, so there every `get` reads the
database (`enabled` is False).

Invalidation is by generation, never by time. `TableWrites` (made with the engine, so no
statement escapes it) counts, per table, every statement this process sends that may write it
(an INSERT, UPDATE or DELETE naming it as its target, from the ORM or Core; any other
statement that is not a SELECT counts for every table) and again the end (commit or rollback)
of each transaction that sent one. A view is served only while its table's count is the one
it was read under, so a read that raced a write (it saw the row before that write committed)
is never served after the commit.
"""

from __future__ import annotations

import math
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine

if TYPE_CHECKING:
    from agentic_sandbox.broker.store.db import Database

#: views kept per table (least recently used dropped first)
MAX_VIEWS = 4096
#: statements that cannot write (also what `sqlite_writer.SerialWriter` lets through)
READ_ONLY = re.compile(r"\s*(select|pragma)\b", re.I)
#: the table a plain INSERT, UPDATE or DELETE writes
_TARGET = re.compile(r'\s*(?:insert\s+(?:or\s+\w+\s+)?into|update|delete\s+from)\s+"?(\w+)', re.I)
_MARK = "rowcache:wrote"


class TableWrites:
    """Counts of the writes this process sent, per table (`"*"`: a statement whose target is
    not known, which counts for every table). Listens from the engine's creation on."""

    def __init__(self, engine: Engine) -> None:
        self.counts: dict[str, int] = {}
        event.listen(engine, "before_cursor_execute", self._statement)
        event.listen(engine, "commit", self._ended)
        event.listen(engine, "rollback", self._ended)

    def generation(self, table: str) -> int:
        return self.counts.get(table, 0) + self.counts.get("*", 0)

    def _bump(self, tables: set[str] | frozenset[str]) -> None:
        for t in tables:
            self.counts[t] = self.counts.get(t, 0) + 1

    def _statement(
        self,
        conn: Connection,
        _cursor: Any,
        statement: str,
        _params: Any,
        _context: Any,
        _executemany: bool,
    ) -> None:
        if READ_ONLY.match(statement):
            return
        target = _TARGET.match(statement)
        table = target.group(1).lower() if target else "*"
        self._bump({table})
        conn.info.setdefault(_MARK, set()).add(table)

    def _ended(self, conn: Connection) -> None:
        try:
            if conn.invalidated or conn.closed:
                raise LookupError("no connection")
            wrote = conn.info.pop(_MARK, None)
        except Exception:  # a listener never raises into SQLAlchemy's rollback
            # its `info` is gone with it (a statement cancelled at shutdown); whatever it sent
            # may still have been written: count it for every table
            self._bump({"*"})
            return
        if wrote:
            self._bump(wrote)


V = TypeVar("V")


class RowCache(Generic[V]):
    """Views (`load(key)`) of the rows of `table`, served until this process writes the table
    (a view read from several tables, a join: `table` is all of them, and a write to any one
    ends it).

    On a database whose writes this process cannot see all of (PostgreSQL: `db.writes` is
    None), a view is served for at most `untracked_ttl` seconds (0: every `get` reads)."""

    def __init__(
        self,
        db: Database,
        table: str | tuple[str, ...],
        load: Callable[[str], Awaitable[V | None]],
        *,
        untracked_ttl: float = 0.0,
    ) -> None:
        self._load = load
        self._views: OrderedDict[str, tuple[int, float, V]] = OrderedDict()
        self._writes = db.writes
        self._tables = tuple(t.lower() for t in ((table,) if isinstance(table, str) else table))
        self._ttl = math.inf if db.writes is not None else untracked_ttl
        self.enabled = self._ttl > 0

    @property
    def generation(self) -> int:
        if self._writes is None:
            return 0
        # counts only grow, so their sum moves whenever any one of them does
        return sum(self._writes.generation(t) for t in self._tables)

    async def get(self, key: str) -> V | None:
        """The view of row `key` (None: no such row), from memory when it is current."""
        if not self.enabled:
            return await self._load(key)
        now = time.monotonic()
        kept = self._views.get(key)
        if kept is not None and kept[0] == self.generation and kept[1] > now:
            self._views.move_to_end(key)
            return kept[2]
        read_under = self.generation
        view = await self._load(key)
        if view is not None and self.generation == read_under:
            self._views[key] = (read_under, now + self._ttl, view)
            self._views.move_to_end(key)
            while len(self._views) > MAX_VIEWS:
                self._views.popitem(last=False)
        return view

    def forget(self, key: str) -> None:
        """Read `key` again next time (what this process knows changed it, off the database)."""
        self._views.pop(key, None)
