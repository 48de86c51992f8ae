"""Run budgets enforced by the kernel: one cgroup per run, nested in the agent's own cgroup.

Every exec run gets its own cgroup (also without limits: that is how its CPU time and peak
memory are measured), created under the cgroup the agent itself runs in, in each hierarchy —
never anywhere else, so whatever placed the agent (systemd, a container, a sandbox) still
accounts for everything its runs do. A run is in its cgroup before it can run or fork anything
of its own: an exec's child is put there by the agent (`RunCgroup.join`) while it is held
before its exec (`exec.py`), a PTY session's child joins between fork and exec. Limits are the
kernel's, not a poll loop's:

| budget | cgroup v2 (guests: Debian 12, systemd) | cgroup v1 (hybrid hosts) |
|---|---|---|
| memory | `memory.max`, `swap.max`=0, `oom.group`=1 | `memory.limit_in_bytes` (+memsw) |
| pids | `pids.max` | `pids.max` |
| cpu | `cpu.max` (quota per 100 ms period) | `cpu.cfs_quota_us` / `cpu.cfs_period_us` |
| usage | `cpu.stat` usage_usec, `memory.peak` | `cpuacct.usage`, `memory.max_usage_in_bytes` |
| end | `cgroup.kill` | freeze (`freezer`), SIGKILL every member, thaw |

An exceeded memory or pids budget ends the run (reason `memory`, `pids`): the kernel tells the
agent — v2 by a modify event on `memory.events` / `pids.events` (epoll, `EPOLLPRI`), v1 memory
by an eventfd on `memory.oom_control`. The v1 pids controller raises no event (measured on a
6.x kernel): there, and only while a run has a pids budget, `pids.events` is read every 100 ms
(the kernel still refuses every fork past the limit; the read only decides when to end the run).
Wall-clock timeouts and output bytes are the agent's own (a timer; bytes counted as read).

**cgroup v2**: the agent's cgroup is delegated to it (the guest's unit has `Delegate=yes`).
A cgroup with processes may not enable controllers for its children, so at start the agent
moves itself into a leaf `<own>/agent` (PTY sessions start there too), enables the controllers
in `<own>` and in `<own>/runs`, and puts each run in `<own>/runs/<pid>-<name>`.
**cgroup v1**: each controller's hierarchy is used directly: `<mount><own>/agentic-sandbox/
<pid>-<name>` for memory, pids, cpu, cpuacct and freezer (whichever are mounted).
**Spares**: an exec takes a run cgroup the agent made empty ahead (`<pid>-spare-<n>`,
`SPARES` of them, made after a run has answered) instead of making its own while the caller
waits (one mkdir per v1 hierarchy: half a millisecond on a host); a session keeps a cgroup of
its own name, which a new worker finds again. Spares are removed at the agent's exit and at a
hand-over (a dead agent's are swept by pid with the rest).
Without root, or without a usable hierarchy, budgets that need a controller are refused with
the reason (`problem`) rather than pretended; timeout and output bytes still work, and usage
falls back to the exit status's rusage. `enforcement` says which case a run was in.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import select
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agentic_sandbox.proto import agent_pb2 as pb

log = logging.getLogger(__name__)

CONTROLLERS_V1 = ("memory", "pids", "cpu", "cpuacct", "freezer")
CONTROLLERS_V2 = ("memory", "pids", "cpu")
BASE_NAME = "agentic-sandbox"
CPU_PERIOD_US = 100_000
PIDS_POLL_V1 = 0.1
REMOVE_TRIES = 100
REMOVE_RETRY = 0.05
#: empty run cgroups made ahead for execs (a v1 run's dirs are one mkdir per hierarchy; made
#: after a run has answered, not while the next one waits)
SPARES = 2
#: the budgets each controller enforces (timeout and output bytes need none)
NEEDS = {"memory": "memory", "pids": "pids", "cpu": "cpu"}


class BudgetRefused(Exception):
    """A budget this agent cannot enforce (the field and why)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass
class Usage:
    cpu_us: int | None = None
    peak_bytes: int | None = None
    oom_kills: int = 0
    pids_refused: int = 0


def _read(path: Path) -> str:
    """A cgroup file's text ("" if it cannot be read): one open and read, no buffered file
    (half the time of `read_text`; a run's end reads several)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        parts = [os.read(fd, 1 << 16)]
        while parts[-1]:  # a long list (a fork bomb's pids) takes several reads
            parts.append(os.read(fd, 1 << 16))
    except OSError:
        return ""
    finally:
        os.close(fd)
    return b"".join(parts).decode(errors="replace")


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _keyed(text: str, key: str) -> int:
    """The value of `key N` in a flat-keyed cgroup file."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            try:
                return int(value.split()[0])
            except (ValueError, IndexError):
                return 0
    return 0


def _int(text: str) -> int | None:
    try:
        return int(text.strip())
    except ValueError:
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ================================================================================== shared by runs
def kill_run(cg: RunCgroup | None, pgid: int) -> None:
    """SIGKILL everything of a run: its cgroup (when it has one) and its process group."""
    if cg is not None:
        cg.kill()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def measured(usage: Usage, rusage: object | None) -> tuple[int, int]:
    """(CPU µs, peak bytes) of a run: its cgroup's figures, else its exit status's rusage
    (the children's CPU time, the largest process's RSS)."""
    cpu = usage.cpu_us
    if cpu is None and rusage is not None:
        cpu = int((rusage.ru_utime + rusage.ru_stime) * 1_000_000)  # type: ignore[attr-defined]
    peak = usage.peak_bytes
    if peak is None and rusage is not None:
        peak = int(rusage.ru_maxrss) * 1024  # type: ignore[attr-defined]
    return cpu or 0, peak or 0


def over_output(cap: int, written: int) -> int:
    """Bytes written past an output budget of `cap` (0: none, or no budget)."""
    return written - cap if cap and written > cap else 0


# ================================================================================== a run's cgr
@dataclass
class RunCgroup:
    """The cgroup(s) of one run; `dirs` maps a controller (v2: "" for the one dir) to its dir."""

    version: int
    dirs: dict[str, Path]
    budget: pb.Budget
    _watch_fds: list[int] = field(default_factory=list)
    _epoll: select.epoll | None = None
    _timer: asyncio.TimerHandle | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _exceeded: Callable[[str], None] | None = None
    _seen: dict[str, int] = field(default_factory=dict)

    @property
    def enforcement(self) -> str:
        return f"cgroup-v{self.version}"

    def _dir(self, controller: str) -> Path | None:
        return self.dirs.get("" if self.version == 2 else controller)

    def join(self, pid: int) -> None:
        """Put `pid` (a child held before its exec, see `exec.py`) into every cgroup of the run,
        from the parent."""
        value = str(pid)
        for d in dict.fromkeys(self.dirs.values()):
            _write(d / "cgroup.procs", value)

    # ---- limits ------------------------------------------------------------------------------
    def apply(self) -> None:
        b = self.budget
        if self.version == 2:
            d = self.dirs[""]
            if b.memory_bytes:
                _write(d / "memory.max", str(b.memory_bytes))
                if (d / "memory.swap.max").exists():
                    _write(d / "memory.swap.max", "0")
                if (d / "memory.oom.group").exists():
                    _write(d / "memory.oom.group", "1")
            if b.pids:
                _write(d / "pids.max", str(b.pids))
            if b.cpu_millis:
                _write(d / "cpu.max", f"{b.cpu_millis * CPU_PERIOD_US // 1000} {CPU_PERIOD_US}")
            return
        if b.memory_bytes:
            d = self.dirs["memory"]
            _write(d / "memory.limit_in_bytes", str(b.memory_bytes))
            if (d / "memory.memsw.limit_in_bytes").exists():
                _write(d / "memory.memsw.limit_in_bytes", str(b.memory_bytes))
        if b.pids:
            _write(self.dirs["pids"] / "pids.max", str(b.pids))
        if b.cpu_millis:
            d = self.dirs["cpu"]
            _write(d / "cpu.cfs_period_us", str(CPU_PERIOD_US))
            _write(d / "cpu.cfs_quota_us", str(b.cpu_millis * CPU_PERIOD_US // 1000))

    # ---- the kernel's word -------------------------------------------------------------------
    def counters(self) -> tuple[int, int]:
        """(OOM kills, refused forks) in this run so far."""
        oom = refused = 0
        mem = self._dir("memory")
        if mem is not None:
            name = "memory.events" if self.version == 2 else "memory.oom_control"
            oom = _keyed(_read(mem / name), "oom_kill")
        pids = self._dir("pids")
        if pids is not None:
            refused = _keyed(_read(pids / "pids.events"), "max")
        return oom, refused

    def exceeded(self, usage: Usage | None = None) -> str:
        """The budget the kernel enforced in this run, if any ("memory", "pids" or ""), from
        `usage` when it was just read."""
        oom, refused = self.counters() if usage is None else (usage.oom_kills, usage.pids_refused)
        if oom and self.budget.memory_bytes:
            return "memory"
        if refused and self.budget.pids:
            return "pids"
        return ""

    def watch(self, loop: asyncio.AbstractEventLoop, on_exceeded: Callable[[str], None]) -> None:
        """Call `on_exceeded(reason)` when the kernel enforces the memory or pids budget."""
        self._loop = loop
        self._exceeded = on_exceeded
        b = self.budget
        if not (b.memory_bytes or b.pids):
            return
        ep = self._epoll = select.epoll()
        if self.version == 2:
            for controller, name in (("memory", "memory.events"), ("pids", "pids.events")):
                d = self._dir(controller)
                if d is None or not (d / name).exists():
                    continue
                fd = os.open(d / name, os.O_RDONLY | os.O_CLOEXEC)
                os.pread(fd, 4096, 0)
                self._watch_fds.append(fd)
                ep.register(fd, select.EPOLLPRI | select.EPOLLERR)
        else:
            mem = self._dir("memory")
            if b.memory_bytes and mem is not None:
                efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
                cfd = os.open(mem / "memory.oom_control", os.O_RDONLY | os.O_CLOEXEC)
                self._watch_fds += [efd, cfd]
                _write(mem / "cgroup.event_control", f"{efd} {cfd}")
                ep.register(efd, select.EPOLLIN)
            if b.pids and self._dir("pids") is not None:
                self._timer = loop.call_later(PIDS_POLL_V1, self._check_pids)
        loop.add_reader(ep.fileno(), self._on_event)

    def _on_event(self) -> None:
        if self._epoll is None:
            return
        for fd, _ in self._epoll.poll(0):
            if self.version == 1:
                with contextlib.suppress(OSError):
                    os.eventfd_read(fd)
            else:
                with contextlib.suppress(OSError):
                    os.pread(fd, 4096, 0)  # re-arms the notification
        reason = self.exceeded()
        if reason and self._exceeded is not None:
            self._exceeded(reason)

    def _check_pids(self) -> None:
        self._timer = None
        if self.exceeded() == "pids" and self._exceeded is not None:
            self._exceeded("pids")
        elif self._loop is not None and self._exceeded is not None:
            self._timer = self._loop.call_later(PIDS_POLL_V1, self._check_pids)

    def unwatch(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._epoll is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._epoll.fileno())
            self._epoll.close()
            self._epoll = None
        for fd in self._watch_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._watch_fds.clear()
        self._exceeded = None

    # ---- usage and the end -------------------------------------------------------------------
    def usage(self) -> Usage:
        u = Usage()
        u.oom_kills, u.pids_refused = self.counters()
        if self.version == 2:
            d = self.dirs[""]
            usec = _keyed(_read(d / "cpu.stat"), "usage_usec")
            u.cpu_us = usec if (d / "cpu.stat").exists() else None
            u.peak_bytes = _int(_read(d / "memory.peak"))
        else:
            acct = self._dir("cpuacct")
            if acct is not None:
                ns = _int(_read(acct / "cpuacct.usage"))
                u.cpu_us = None if ns is None else ns // 1000
            mem = self._dir("memory")
            if mem is not None:
                u.peak_bytes = _int(_read(mem / "memory.max_usage_in_bytes"))
        return u

    def members(self) -> list[int]:
        for d in dict.fromkeys(self.dirs.values()):
            text = _read(d / "cgroup.procs")
            if text:
                return [int(p) for p in text.split()]
        return []

    def kill(self) -> None:
        """SIGKILL every process of the run, including ones forking as it happens."""
        if self.version == 2:
            d = self.dirs[""]
            if (d / "cgroup.kill").exists():
                with contextlib.suppress(OSError):
                    _write(d / "cgroup.kill", "1")
                    return
            self._kill_frozen(d / "cgroup.freeze", "1", "0")
            return
        if not self.members():
            return  # nothing left (the usual end of a run): an empty cgroup cannot fork
        freezer = self._dir("freezer")
        if freezer is not None:
            self._kill_frozen(freezer / "freezer.state", "FROZEN", "THAWED")
        else:
            for _ in range(5):
                pids = self.members()
                if not pids:
                    break
                self._kill_all(pids)

    def _kill_frozen(self, state: Path, frozen: str, thawed: str) -> None:
        try:
            _write(state, frozen)
        except OSError:
            self._kill_all(self.members())
            return
        for _ in range(1000):  # freezing is quick; a task stuck in the kernel may delay it
            text = _read(state).strip()
            if text in (frozen, "") or state.name == "cgroup.freeze":
                break
        self._kill_all(self.members())
        with contextlib.suppress(OSError):
            _write(state, thawed)

    @staticmethod
    def _kill_all(pids: list[int]) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def remove(self, loop: asyncio.AbstractEventLoop | None = None, tries: int = 0) -> None:
        """Remove the run's cgroups (once the kernel has let go of its last process)."""
        self.unwatch()
        left: dict[str, Path] = {}
        for key, d in self.dirs.items():
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno == errno.EBUSY:
                    left[key] = d
                else:
                    log.warning("cannot remove cgroup %s: %s", d, exc)
        self.dirs = left
        if left:
            if self.members():
                self.kill()
            if loop is not None and tries < REMOVE_TRIES:
                loop.call_later(REMOVE_RETRY, self.remove, loop, tries + 1)
            elif tries >= REMOVE_TRIES:
                log.warning("cgroups of a run still busy: %s", ", ".join(map(str, left.values())))


# ================================================================================== detection
@dataclass
class Cgroups:
    """What this agent can enforce, and where its runs' cgroups go."""

    version: int = 0  # 0: none
    bases: dict[str, Path] = field(default_factory=dict)  # v1: per controller; v2: {"": dir}
    controllers: frozenset[str] = frozenset()
    problem: str = ""
    _spares: list[dict[str, Path]] = field(default_factory=list)
    _spare_seq: int = 0

    @property
    def enforcement(self) -> str:
        return f"cgroup-v{self.version}" if self.version else "none"

    @property
    def budgets(self) -> list[str]:
        out = ["timeout", "output_bytes"]
        out += [b for b, c in NEEDS.items() if c in self.controllers]
        return out

    def support(self) -> pb.BudgetSupport:
        return pb.BudgetSupport(
            enforcement=self.enforcement, budgets=self.budgets, problem=self.problem
        )

    def check(self, budget: pb.Budget) -> None:
        """Refuse a budget that cannot be enforced here (naming the field and the reason)."""
        asked = {
            "memory": budget.memory_bytes,
            "pids": budget.pids,
            "cpu": budget.cpu_millis,
        }
        for name, value in asked.items():
            if value and NEEDS[name] not in self.controllers:
                why = self.problem or f"the {NEEDS[name]} controller is not available"
                raise BudgetRefused(f"budget.{name}", f"cannot enforce a {name} budget: {why}")

    def create(self, name: str, budget: pb.Budget, *, spare: bool = False) -> RunCgroup | None:
        """A run's cgroup with its limits, or None when this agent has no cgroups. With
        `spare`, one made ahead (`refill`) when there is one: its name is not `name` then
        (only sessions are found again by name)."""
        self.check(budget)
        if not self.version:
            return None
        if spare and self._spares:
            dirs = self._spares.pop()
        else:
            try:
                dirs = self._make(f"{os.getpid()}-{name}")
            except OSError as exc:
                raise BudgetRefused("budget", f"cannot set up the run's cgroup: {exc}") from None
        run = RunCgroup(self.version, dirs, budget)
        try:
            run.apply()
        except OSError as exc:
            run.remove()
            raise BudgetRefused("budget", f"cannot set up the run's cgroup: {exc}") from None
        return run

    def _make(self, leaf: str) -> dict[str, Path]:
        """The empty dirs of a run named `leaf` (none left behind if one cannot be made)."""
        dirs = {key: base / leaf for key, base in self.bases.items()}
        made: list[Path] = []
        try:
            for d in dirs.values():
                for _ in range(3):  # another agent may remove an empty v1 base as it exits
                    d.parent.mkdir(exist_ok=True)
                    try:
                        d.mkdir()
                        break
                    except FileNotFoundError:
                        continue
                else:
                    d.mkdir()
                made.append(d)
        except OSError:
            for d in made:
                with contextlib.suppress(OSError):
                    d.rmdir()
            raise
        return dirs

    def refill(self) -> None:
        """Make spare run cgroups up to `SPARES` (a failure only means the next run makes its
        own, and says why if it cannot)."""
        while self.version and len(self._spares) < SPARES:
            self._spare_seq += 1
            try:
                self._spares.append(self._make(f"{os.getpid()}-spare-{self._spare_seq}"))
            except OSError as exc:
                log.debug("cannot make a spare run cgroup: %s", exc)
                return

    def drop_spares(self) -> None:
        for dirs in self._spares:
            RunCgroup(self.version, dirs, pb.Budget()).remove()
        self._spares.clear()

    def sweep(self, keep: frozenset[str] = frozenset()) -> None:
        """End what runs of agents that are gone (a kill -9) left behind, and remove their
        cgroups (except `keep`: sessions a new worker took on)."""
        leftovers: dict[str, dict[str, Path]] = {}
        for key, base in self.bases.items():
            with contextlib.suppress(OSError):
                for entry in base.iterdir():
                    pid_text = entry.name.partition("-")[0]
                    if entry.name in keep:
                        continue
                    if entry.is_dir() and pid_text.isdigit() and not _pid_alive(int(pid_text)):
                        leftovers.setdefault(entry.name, {})[key] = entry
        for dirs in leftovers.values():
            run = RunCgroup(self.version, dirs, pb.Budget())
            if run.members():
                log.warning("ending processes a previous agent's run left: %s", list(dirs.values()))
                run.kill()
            run.remove()

    def release(self) -> None:
        """At exit: remove the spares, and the shared v1 base cgroups if no other agent uses
        them."""
        self.drop_spares()
        if self.version != 1:
            return
        for base in self.bases.values():
            with contextlib.suppress(OSError):
                base.rmdir()


def _mounts(mountinfo: str) -> list[tuple[str, str, str, set[str]]]:
    """(fstype, mount root, mount point, super options) of every cgroup mount."""
    out = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields = left.split()
        rfields = right.split()
        if len(fields) < 5 or len(rfields) < 3 or rfields[0] not in ("cgroup", "cgroup2"):
            continue
        out.append((rfields[0], fields[3], fields[4], set(rfields[2].split(","))))
    return out


def _under(mount_root: str, mount_point: str, path: str) -> Path:
    rel = path
    if mount_root != "/" and (path == mount_root or path.startswith(mount_root + "/")):
        rel = path[len(mount_root) :] or "/"
    return Path(mount_point + rel.rstrip("/"))


def detect(
    proc: Path = Path("/proc/self"),
    *,
    prepare: bool = True,
    keep: frozenset[str] = frozenset(),
    keeper: int = 0,
) -> Cgroups:
    """Find the agent's cgroups; on v2 also take the delegated cgroup over (`prepare`).
    `keep`: run cgroups (by name) of sessions taken on from a previous worker, which the sweep
    of a dead agent's leftovers spares; `keeper`: the keeper's pid, moved into the agent's
    leaf with it (v2 allows no process beside child cgroups)."""
    if os.geteuid() != 0:
        return Cgroups(problem="the agent does not run as root")
    own: dict[str, str] = {}
    for line in _read(proc / "cgroup").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for c in parts[1].split(",") if parts[1] else [""]:
                own[c] = parts[2]
    mounts = _mounts(_read(proc / "mountinfo"))
    v1: dict[str, Path] = {}
    for fstype, root, point, opts in mounts:
        if fstype != "cgroup":
            continue
        for c in CONTROLLERS_V1:
            if c in opts and c in own and c not in v1:
                v1[c] = _under(root, point, own[c])
    if set(v1) & set(CONTROLLERS_V2):
        return _prepare_v1(v1, keep)
    for fstype, root, point, _ in mounts:
        if fstype == "cgroup2" and "" in own:
            available = set(_read(Path(point) / "cgroup.controllers").split())
            if available & set(CONTROLLERS_V2):
                here = _under(root, point, own[""])
                if not prepare:
                    return Cgroups()
                return _prepare_v2(Path(point), here, available, keep, keeper)
    return Cgroups(problem="no cgroup hierarchy with the memory, pids or cpu controller")


def _prepare_v1(own: dict[str, Path], keep: frozenset[str] = frozenset()) -> Cgroups:
    bases: dict[str, Path] = {}
    problems = []
    for c, d in own.items():
        base = d / BASE_NAME
        try:
            base.mkdir(exist_ok=True)
        except OSError as exc:
            problems.append(f"{c}: {exc}")
            continue
        bases[c] = base
    cg = Cgroups(
        version=1,
        bases=bases,
        controllers=frozenset(c for c in bases if c in CONTROLLERS_V2),
        problem="; ".join(problems),
    )
    cg.sweep(keep)
    return cg


def _enable(d: Path, controllers: list[str]) -> None:
    _write(d / "cgroup.subtree_control", " ".join(f"+{c}" for c in controllers))


def _prepare_v2(
    mount: Path,
    here: Path,
    available: set[str],
    keep: frozenset[str] = frozenset(),
    keeper: int = 0,
) -> Cgroups:
    wanted = [c for c in CONTROLLERS_V2 if c in available]
    if here.name == "agent" and (here.parent / "runs").is_dir():
        here = here.parent  # a worker its keeper restarted starts in the agent's leaf
    try:
        if here == mount:  # the root cgroup may hold processes and enable controllers
            base = mount / BASE_NAME
            _enable(mount, wanted)
        else:
            leaf = here / "agent"
            leaf.mkdir(exist_ok=True)
            for pid in (keeper, os.getpid()) if keeper else (os.getpid(),):
                _write(leaf / "cgroup.procs", str(pid))
            _enable(here, wanted)
            base = here / "runs"
        base.mkdir(exist_ok=True)
        _enable(base, wanted)
    except OSError as exc:
        hint = (
            " (the agent's cgroup holds other processes: run it in a cgroup of its own, "
            "e.g. a systemd unit with Delegate=yes)"
            if exc.errno == errno.EBUSY
            else ""
        )
        return Cgroups(problem=f"cannot delegate cgroups under {here}: {exc}{hint}")
    enabled = {c.lstrip("+") for c in _read(base / "cgroup.subtree_control").split()}
    cg = Cgroups(version=2, bases={"": base}, controllers=frozenset(enabled & set(wanted)))
    cg.sweep(keep)
    return cg
