"""Watching the guest's serial console for an agent that dies at start, while a provision waits
for it to enroll.

The agent's systemd unit sends its output to the journal and the console
(`StandardOutput=journal+console`) under the identifier `agentic-sandbox-agent`
(`SyslogIdentifier`), so each of its lines reaches the serial log as

    [   73.004875] agentic-sandbox-agent[309]: Traceback (most recent call last):

with the process id of that start of the agent. `AgentConsoleWatch` reads these lines as they
come (bytes, in any chunks) and decides that the agent cannot start when

* a traceback ends in an error that retrying cannot mend (`ImportError`,
  `ModuleNotFoundError`, `SyntaxError`: the bundle or the guest's runtime is broken) — at once;
* or the agent has been started `max_restarts + 1` times (a new process id each time systemd
  restarts it) without the provision seeing it enroll — a crash loop, whatever its output.

Its verdict names how often the agent started and carries the last lines of its last traceback
(or of its output), which become the failed operation's cause.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

AGENT_IDENTIFIER = "agentic-sandbox-agent"
FATAL_AT_START = ("ImportError", "ModuleNotFoundError", "SyntaxError", "IndentationError")
TRACEBACK_START = "Traceback (most recent call last):"

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_JOURNAL_LINE = re.compile(
    r"\[\s*\d+\.\d+\]\s+(?P<ident>[^\s\[\]]+)\[(?P<pid>\d+)\]:\s?(?P<text>.*)$"
)
_CARETS = re.compile(r"^\s*[\^~]+\s*$")  # 3.11's markers under the failing expression
_EXCEPTION_LINE = re.compile(r"^(?P<name>[A-Za-z_][\w.]*)(?::\s.*)?$")


@dataclass(frozen=True)
class AgentCrash:
    """The agent does not come up: how many times it started, and its last words."""

    starts: int
    exception: str  # e.g. "ImportError", or "" when its output shows no traceback
    last_lines: tuple[str, ...]

    def cause(self) -> str:
        what = f" with {self.exception}" if self.exception else ""
        times = "once" if self.starts == 1 else f"{self.starts} times"
        head = f"the agent exits at start{what} (started {times}, never enrolled)"
        body = "\n".join(f"  {line}" for line in self.last_lines)
        return f"{head}; its console output ends:\n{body}" if body else head


@dataclass
class _Start:
    """One start of the agent (one process id)."""

    pid: str
    lines: list[str] = field(default_factory=list)
    traceback_at: int | None = None  # index in `lines` of the last traceback's first line
    exception: str = ""  # the exception that ended the last traceback


class AgentConsoleWatch:
    def __init__(
        self, *, identifier: str = AGENT_IDENTIFIER, max_restarts: int = 2, tail: int = 8
    ) -> None:
        self.identifier = identifier
        self.max_restarts = max_restarts
        self.tail = tail
        self._partial = b""
        self._starts: list[_Start] = []

    @property
    def starts(self) -> int:
        return len(self._starts)

    def feed(self, data: bytes) -> AgentCrash | None:
        """Take the next bytes of the console; an `AgentCrash` once the agent cannot start."""
        chunk = self._partial + data
        *complete, self._partial = chunk.split(b"\n")
        for raw in complete:
            self._line(raw.decode("utf-8", "replace"))
        return self.verdict()

    def _line(self, raw: str) -> None:
        text = _ANSI.sub("", raw).replace("\r", "")
        m = _JOURNAL_LINE.search(text)  # a login prompt may come first on the line
        if m is None or m["ident"] != self.identifier:
            return
        pid, line = m["pid"], m["text"]
        start = self._starts[-1] if self._starts else None
        if start is None or start.pid != pid:
            if any(s.pid == pid for s in self._starts):
                return  # a late line of an earlier start
            start = _Start(pid)
            self._starts.append(start)
        start.lines.append(line)
        del start.lines[: -max(self.tail * 4, 40)]
        if line.strip() == TRACEBACK_START:
            start.traceback_at = len(start.lines) - 1
            start.exception = ""
        elif start.traceback_at is not None and not line.startswith((" ", "\t")):
            ex = _EXCEPTION_LINE.match(line)
            if ex is not None and not start.exception:
                start.exception = ex["name"].rsplit(".", 1)[-1]

    def verdict(self) -> AgentCrash | None:
        if not self._starts:
            return None
        fatal = next((s for s in reversed(self._starts) if s.exception in FATAL_AT_START), None)
        if fatal is not None:
            return self._crash(fatal)
        if len(self._starts) > self.max_restarts:
            # the agent was restarted that many times: the last finished start tells why
            finished = self._starts[:-1]
            crashed = next((s for s in reversed(finished) if s.exception), finished[-1])
            return self._crash(crashed)
        return None

    def _crash(self, start: _Start) -> AgentCrash:
        lines = start.lines
        if start.traceback_at is not None and start.exception:
            lines = lines[start.traceback_at :]
        return AgentCrash(
            starts=len(self._starts),
            exception=start.exception,
            last_lines=tuple(
                line.rstrip() for line in [x for x in lines if not _CARETS.match(x)][-self.tail :]
            ),
        )
