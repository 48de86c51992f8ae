"""Runs: a task becomes a PTY session on its instance, through the session contract only.

- start: open the session (the run's argv, env, user), then `submitted -> working` with the
  session id in the task metadata (attachable live);
- pump: `follow_output(session_id, offset)` -> TaskArtifactUpdateEvents (UTF-8 decoded
  incrementally, so a character split across chunks is never mangled); the stored offset only
  covers output that is stored too, so after a restart the stream resumes with no gap and no
  duplicate;
- HITL: a prompt in the run's output moves the task to input-required (once the output up to
  the prompt has been streamed); an answer is written to the PTY and the task goes back to
  working;
- cancel: TERM, then KILL after the grace period;
- end: exit 0 -> completed, another code or a signal -> failed, a cancel -> canceled, a run
  the agent lost (or that never comes back after a restart) -> failed with the reason;
- budget: the run's session carries the task's budget (the agent enforces it in the run's own
  cgroup); a run that exceeds it fails with the named reason (`timeout`, `memory`, `pids`,
  `output-limit`) leading its final status message, in `metadata.budgetExceeded` and in the
  `task.failed` event; every run's usage (CPU time, peak memory, output bytes) goes into
  `metadata.usage`, the run's row and the terminal `task.*` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import posixpath
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from agentic_sandbox.broker.agentlink import FileInfo
from agentic_sandbox.broker.config import Settings
from agentic_sandbox.broker.http.problems import ProblemError
from agentic_sandbox.broker.sessions import (
    AgentUnavailable,
    ExitStatus,
    OutputChunk,
    Prompt,
    SessionEnded,
    SessionError,
    SessionNotFound,
    SessionService,
    SessionSpec,
    agent_budget_spec,
)
from agentic_sandbox.broker.tasks.errors import TaskNotCancelable, TaskNotWaiting
from agentic_sandbox.broker.tasks.files import TaskFileError, TaskFiles, WorkDir, outbox_artifacts
from agentic_sandbox.broker.tasks.live import LiveTask, LiveTasks, RunState
from agentic_sandbox.broker.tasks.machine import Step, TaskMachine
from agentic_sandbox.broker.tasks.record import utcnow
from agentic_sandbox.broker.tasks.skills import RunPlan
from agentic_sandbox.broker.tasks.states import IllegalTransition, TaskState

log = logging.getLogger(__name__)

SYSTEM_ACTOR = "system:tasks"
HITL_ACTOR = "system:hitl"
PROMPT_SETTLE_SECONDS = 1.0
WORKING_WRITE_DELAY = 0.02  # see _execute
STOP_OPEN_WAIT = 5.0  # how long a stop waits for runs being started (see stop)
KILL_CONFIRM_SECONDS = 5.0


class TaskRunner:
    def __init__(
        self,
        *,
        machine: TaskMachine,
        live: LiveTasks,
        sessions: Callable[[], SessionService | None],
        cancel_grace: float,
        recovery_grace: float,
        on_run_end: Callable[[LiveTask], None],
        settings: Settings | None = None,
    ) -> None:
        self.settings = settings or Settings()
        self.files: TaskFiles | None = None  # A2A file parts (files.py), when wired
        # (up, down) egress bytes of a run's connections (the egress proxy's count), when wired
        self.egress_bytes: Callable[[str], tuple[int, int]] | None = None
        self.machine = machine
        self.live = live
        self._sessions = sessions
        self.cancel_grace = cancel_grace
        self.recovery_grace = recovery_grace
        self._on_run_end = on_run_end
        self._background: set[asyncio.Task[None]] = set()

    @property
    def sessions(self) -> SessionService:
        svc = self._sessions()
        if svc is None:
            raise AgentUnavailable("the session layer is not running")
        return svc

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def stop(self) -> None:
        """Stop following runs (they go on in the guests) and store what was streamed. Runs
        being started finish starting first (bounded): stopped mid-open, a run would be on the
        agent with nothing stored to say so, and the next leader could only give it up."""
        starting = [
            live.run.opened.wait()
            for live in self.live.all()
            if live.run is not None
            and live.run.session_id is None  # being started (adopted runs have their session)
            and not live.run.opened.is_set()
            and live.run.runner is not None
            and not live.run.runner.done()
        ]
        if starting:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(
                    min(STOP_OPEN_WAIT, self.settings.session_open_timeout_seconds)
                ):
                    await asyncio.gather(*starting)
        for live in self.live.all():
            run = live.run
            if run is not None and run.pending_start is not None:
                if run.start_timer is not None:
                    run.start_timer.cancel()
                step, run.pending_start = run.pending_start, None
                with contextlib.suppress(Exception):
                    await self._working(live, step)
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(Exception):
            await self.machine.drain()

    # ---- start ----------------------------------------------------------------------------
    def start(self, live: LiveTask, plan: RunPlan) -> None:
        assert live.run is not None
        live.run.runner = self._spawn(self._execute(live, plan), f"task-run-{live.id[:8]}")

    async def adopt_unconfirmed(self, live: LiveTask, session_id: str) -> None:
        """A run whose session was opened but whose `working` was not stored yet when the
        server stopped (a leader killed right after the start, see `_execute`): store
        `working` now and follow the run. It is never started again."""
        run = live.run
        assert run is not None
        run.session_id = session_id
        self.live.bind_session(live, session_id)
        await self.machine.advance(live, [_working_step(run, "(adopted after a restart)")])
        self.adopt(live)

    def adopt(self, live: LiveTask) -> None:
        """Follow a run that was going on when the server stopped (after a restart)."""
        assert live.run is not None
        live.run.runner = self._spawn(self._follow(live), f"task-adopt-{live.id[:8]}")

    def _workdir(self, instance_id: str, task_id: str) -> WorkDir | None:
        files = self.files
        if files is None or not files.available(instance_id):
            return None
        return WorkDir.of(self.settings.task_files_root, task_id)

    async def _prepare_files(self, live: LiveTask, plan: RunPlan, work: WorkDir) -> None:
        """The working directory, its outbox and the message's files, before the run."""
        rec, files = live.record, self.files
        assert files is not None
        user = plan.user or ""
        try:
            await files.mkdir(rec.instance_id, rec.owner, work.outbox, user)
            for f in plan.files:
                path = posixpath.join(work.path, f.name)
                await files.put(rec.instance_id, rec.owner, path, f.data, user)
        except ProblemError as exc:
            raise TaskFileError(exc.detail) from None

    async def _execute(self, live: LiveTask, plan: RunPlan) -> None:
        rec, run = live.record, live.run
        assert run is not None
        work = self._workdir(rec.instance_id, rec.id)
        env = dict(plan.env)
        # the working directory and outbox: made by the agent as it opens the run's session
        # when it can and no file part must be written there first, else by a mkdir before it
        make_dirs: tuple[str, ...] = ()
        if work is not None and not plan.files and self.files is not None:
            make_dirs = (work.outbox,) if self.files.session_dirs(rec.instance_id) else ()
        if work is not None:
            env.update(work.env())
        spec = SessionSpec(
            instance_id=rec.instance_id,
            owner=rec.owner,
            command=list(plan.argv),
            env=env,
            cwd=plan.cwd or (work.path if work is not None else None),
            user=plan.user,
            name=f"task {rec.id[:8]}",
            task_id=rec.id,
            budget=agent_budget_spec(plan.budget) if plan.budget is not None else None,
            make_dirs=make_dirs,
            # the outbox comes back with the exit (an agent that cannot: a listing stream)
            list_on_exit=work.outbox if work is not None else "",
        )
        run.budget = plan.budget.model_dump(mode="json") if plan.budget is not None else None
        try:
            if work is not None and not make_dirs:
                await self._prepare_files(live, plan, work)
            elif plan.files:
                raise TaskFileError("the instance's agent does not transfer files")
            session_id = await self.sessions.create(spec, actor=SYSTEM_ACTOR)
        except asyncio.CancelledError:
            run.opened.set()
            raise
        except Exception as exc:
            if isinstance(exc, AgentUnavailable):
                reason = f"instance not ready: {exc}"
            elif isinstance(exc, TaskFileError):
                reason = f"the task's files could not be written: {exc}"
            else:
                reason = f"the run could not start: {exc}"
            if not isinstance(exc, SessionError | TaskFileError):
                log.exception("starting task %s failed", rec.id)
            try:
                to = TaskState.canceled if run.cancel_requested else TaskState.rejected
                await self.machine.transition(
                    live,
                    to,
                    actor=SYSTEM_ACTOR,
                    cause=reason,
                    message=reason,
                    run_values={"state": "lost", "reason": reason, "ended_at": utcnow()},
                )
            except IllegalTransition:
                await self._end_run(live, "lost", reason)
            finally:
                run.opened.set()
                self._on_run_end(live)
            return
        run.session_id = session_id
        run.opened.set()
        self.live.bind_session(live, session_id)
        # `working` (with the session id) is stored a moment later, while the run's output is
        # already followed: a run that ends within WORKING_WRITE_DELAY has both transitions
        # stored in one write; a longer one overlaps the write with the command.
        run.pending_start = _working_step(run)
        run.start_timer = asyncio.get_running_loop().call_later(
            WORKING_WRITE_DELAY, self._store_start, live
        )
        if run.cancel_requested:
            await self._signal(live, "TERM")
        await self._follow(live)

    def _store_start(self, live: LiveTask) -> None:
        run = live.run
        if run is None or run.pending_start is None:
            return
        step, run.pending_start = run.pending_start, None
        run.start_timer = None
        run.started = self._spawn(self._working(live, step), f"task-start-{live.id[:8]}")

    async def _working(self, live: LiveTask, step: Step) -> None:
        with contextlib.suppress(IllegalTransition):  # canceled while starting
            await self.machine.advance(live, [step])
        run = live.run
        if run is not None and run.early_prompt is not None:
            prompt, run.early_prompt = run.early_prompt, None
            await self._prompted(live, prompt)

    # ---- follow ---------------------------------------------------------------------------
    async def _follow(self, live: LiveTask) -> None:
        """Follow the run to its end. While the agent is away (link down, server restart) the
        run goes on in the guest and the stream resumes from the stored offset; after
        `recovery_grace` seconds without the agent the run counts as lost."""
        status = await self._watch(live)
        await self._finish(live, status)

    async def _watch(self, live: LiveTask) -> ExitStatus:
        run = live.run
        assert run is not None and run.session_id is not None
        away_since: float | None = None
        error: Exception | None = None
        while True:
            pump = asyncio.ensure_future(self._pump(live))
            try:
                while not pump.done():
                    await asyncio.wait({pump}, timeout=1.0)
                    if pump.done():
                        break
                    if self._agent_ready(live):
                        away_since = None
                    else:
                        away_since = away_since or time.monotonic()
                        if time.monotonic() - away_since > self.recovery_grace:
                            return self._lost(
                                f"the agent was away for over {self.recovery_grace:.0f}s"
                            )
                try:
                    return pump.result()
                except (AgentUnavailable, SessionNotFound) as exc:
                    error = exc
                except Exception as exc:
                    log.exception("following task %s failed", live.id)
                    return self._lost(f"following the run failed: {exc}")
            finally:
                if not pump.done():
                    pump.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await pump
            # the session is not reachable right now: wait for the agent, within the grace
            away_since = away_since or time.monotonic()
            if time.monotonic() - away_since > self.recovery_grace:
                return self._lost(f"{error}; not back within {self.recovery_grace:.0f}s")
            await asyncio.sleep(0.5)

    def _lost(self, reason: str) -> ExitStatus:
        return ExitStatus(code=None, lost=True, reason=reason)

    def _agent_ready(self, live: LiveTask) -> bool:
        svc = self._sessions()
        return svc is not None and svc.agent_ready(live.record.instance_id)

    async def _pump(self, live: LiveTask) -> ExitStatus:
        run = live.run
        assert run is not None and run.session_id is not None
        async for chunk in self.sessions.follow_output(run.session_id, run.offset):
            self._consume(live, chunk)
        return await self.sessions.wait_exit(run.session_id)

    def _consume(self, live: LiveTask, chunk: OutputChunk) -> None:
        run = live.run
        assert run is not None
        data = chunk.data
        end = chunk.offset + len(data)
        if end <= run.offset:
            return  # already have it
        text = ""
        if chunk.offset > run.offset:
            lost = chunk.offset - run.offset
            text = run.decoder.decode(b"", final=True)
            run.decoder.reset()
            text += f"\n[{lost} bytes of output lost]\n"
            run.offset = chunk.offset
        elif chunk.offset < run.offset:
            data = data[run.offset - chunk.offset :]
        text += run.decoder.decode(data)
        run.offset = end
        self.machine.append_output(live, text)
        run.advanced.set()
        run.advanced = asyncio.Event()

    async def _finish(self, live: LiveTask, status: ExitStatus) -> None:
        run = live.run
        assert run is not None
        start = run.pending_start  # `working` not stored yet: it goes with the end
        run.pending_start = None
        if run.start_timer is not None:
            run.start_timer.cancel()
            run.start_timer = None
        if start is None and run.started is not None:
            try:
                await run.started
            except Exception:
                log.exception("recording the start of task %s failed", live.id)
        if start is None and live.record.state is TaskState.submitted:  # `working` failed
            reason = "the run's start could not be recorded; its outcome is unknown"
            with contextlib.suppress(IllegalTransition):
                await self.machine.transition(
                    live,
                    TaskState.rejected,
                    actor=SYSTEM_ACTOR,
                    cause=reason,
                    message=reason,
                    run_values={"state": "lost", "reason": reason, "ended_at": utcnow()},
                )
            self._on_run_end(live)
            return
        rec = live.record
        self.machine.append_output(live, run.decoder.decode(b"", final=True), last_chunk=True)
        meta: dict[str, object] = {}
        work = self._workdir(rec.instance_id, rec.id)
        if work is not None and not (status.lost or run.cancel_requested or rec.state.terminal):
            await self._collect_outbox(live, work, meta, status.listing)
        if status.code is not None:
            meta["exitCode"] = status.code
        if status.signal:
            meta["exitSignal"] = status.signal
        extra: dict[str, object] = {}
        if status.usage is not None:
            u = status.usage
            meta["usage"] = {
                "cpuSeconds": u.cpu_us / 1e6,
                "peakMemoryBytes": u.peak_memory_bytes,
                "outputBytes": u.output_bytes,
                "enforcement": u.enforcement,
            }
            extra["usage"] = u.view()
        if self.egress_bytes is not None:
            up, down = self.egress_bytes(run.id)
            usage = meta.setdefault("usage", {})
            assert isinstance(usage, dict)
            usage["networkEgressBytes"], usage["networkIngressBytes"] = up, down
            view = extra.setdefault("usage", {})
            assert isinstance(view, dict)
            view["network_egress_bytes"], view["network_ingress_bytes"] = up, down
        if run.budget is not None:
            meta["budget"] = run.budget
        if status.exceeded and not run.cancel_requested:
            meta["budgetExceeded"] = status.exceeded
            extra["exceeded"] = status.exceeded
        if run.cancel_requested:
            to, run_state = TaskState.canceled, "canceled"
            how = f" (exit signal {status.signal})" if status.signal else ""
            cause = f"canceled by {run.cancel_actor or 'a client'}{how}"
            message = "canceled" + how
        elif status.lost:
            to, run_state = TaskState.failed, "lost"
            cause = message = f"run lost: {status.reason or 'the agent no longer has it'}"
        elif status.exceeded:
            to, run_state = TaskState.failed, "exceeded"
            cause = message = exceeded_message(status.exceeded, run.budget)
        elif status.code == 0:
            to, run_state = TaskState.completed, "exited"
            cause, message = "exit code 0", "completed (exit code 0)"
        elif status.code is not None:
            to, run_state = TaskState.failed, "exited"
            cause = message = f"exit code {status.code}"
        else:
            to, run_state = TaskState.failed, "exited"
            cause = message = f"killed by signal {status.signal or 'unknown'}"
        if rec.state.terminal:
            await self._end_run(live, run_state, cause, status)
            self._on_run_end(live)
            return
        end = Step(
            to,
            actor=SYSTEM_ACTOR,
            cause=cause,
            message=message,
            metadata=meta,
            run_values={
                "state": run_state,
                "exit_code": status.code,
                "reason": status.reason or cause,
                "ended_at": utcnow(),
                "output_bytes": run.offset,
                **_usage_values(status),
            },
            event_data=extra,
        )
        try:
            await self.machine.advance(live, [start, end] if start is not None else [end])
        except IllegalTransition:
            await self._end_run(live, run_state, cause, status)
        finally:
            self._on_run_end(live)

    async def _collect_outbox(
        self,
        live: LiveTask,
        work: WorkDir,
        meta: dict[str, object],
        listing: Sequence[FileInfo] | None,
    ) -> None:
        files, rec = self.files, live.record
        assert files is not None
        try:
            arts = await outbox_artifacts(
                files,
                listing,
                instance_id=rec.instance_id,
                owner=rec.owner,
                work=work,
                inline_bytes=self.settings.task_file_inline_bytes,
                public_url=self.settings.effective_public_url,
            )
        except TaskFileError as exc:
            meta["outboxError"] = str(exc)[:500]
            return
        except Exception as exc:
            log.exception("collecting the outbox of task %s failed", rec.id)
            meta["outboxError"] = f"collecting the outbox failed: {type(exc).__name__}"
            return
        for art in arts:
            self.machine.add_artifact(live, art)

    async def _end_run(
        self, live: LiveTask, state: str, reason: str, status: ExitStatus | None = None
    ) -> None:
        run = live.run
        assert run is not None
        with contextlib.suppress(Exception):
            await self.machine.store.update_run(
                run.id,
                state=state,
                reason=reason,
                exit_code=status.code if status is not None else None,
                ended_at=utcnow(),
                output_bytes=run.offset,
                **(_usage_values(status) if status is not None else {}),
            )

    # ---- HITL -----------------------------------------------------------------------------
    def on_prompt(self, prompt: Prompt) -> None:
        live = self.live.by_session(prompt.session_id)
        if live is None or live.run is None:
            return
        if live.record.state is TaskState.working:
            self._spawn(self._prompted(live, prompt), f"task-prompt-{live.id[:8]}")
        elif live.record.state is TaskState.submitted and live.run.session_id == prompt.session_id:
            # The run started but `working` is not stored yet (see `_execute`): a prompt that
            # came that early would otherwise be lost, and the task would wait for ever.
            live.run.early_prompt = prompt

    async def _prompted(self, live: LiveTask, prompt: Prompt) -> None:
        run = live.run
        assert run is not None
        deadline = time.monotonic() + PROMPT_SETTLE_SECONDS
        while run.offset < prompt.offset and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(deadline - time.monotonic()):
                    await run.advanced.wait()
        if live.record.state is not TaskState.working:
            return
        text = prompt.text.strip() or "the run waits for input"
        with contextlib.suppress(IllegalTransition):
            await self.machine.transition(
                live,
                TaskState.input_required,
                actor=HITL_ACTOR,
                cause=f"prompt in the run's output: {text[:200]!r}",
                message=text,
                metadata={"prompt": text},
            )

    async def answer(
        self, live: LiveTask, text: str, *, user_message: dict[str, Any], actor: str
    ) -> None:
        rec, run = live.record, live.run
        if rec.state is not TaskState.input_required or run is None or run.session_id is None:
            raise TaskNotWaiting(
                f"task {rec.id} is {rec.state.value}; only a task in input-required takes a "
                "follow-up message"
            )
        await self.machine.transition(
            live,
            TaskState.working,
            actor=actor,
            cause="answered the prompt",
            user_message=user_message,
        )
        data = text if text.endswith(("\n", "\r")) else text + "\r"
        try:
            await self.sessions.write(run.session_id, data.encode(), actor=actor)
        except (SessionEnded, SessionNotFound):
            pass  # the run is ending on its own; its exit decides the state

    # ---- cancel ---------------------------------------------------------------------------
    async def cancel(self, live: LiveTask, *, actor: str) -> None:
        rec, run = live.record, live.run
        if rec.state.terminal:
            raise TaskNotCancelable(f"task {rec.id} is already {rec.state.value}")
        if run is None:
            with contextlib.suppress(IllegalTransition):
                await self.machine.transition(
                    live,
                    TaskState.canceled,
                    actor=actor,
                    cause=f"canceled by {actor} before it ran",
                    message="canceled before it ran",
                )
            self._on_run_end(live)
            return
        run.cancel_requested = True
        run.cancel_actor = actor
        if run.session_id is not None:
            await self._signal(live, "TERM")
        if await _wait(live.ended, self.cancel_grace):
            return
        if run.session_id is not None:
            await self._signal(live, "KILL")
        if await _wait(live.ended, KILL_CONFIRM_SECONDS):
            return
        # The agent never confirmed the exit (link down?): the task ends anyway; a late exit
        # finds it terminal and changes nothing.
        with contextlib.suppress(IllegalTransition):
            await self.machine.transition(
                live,
                TaskState.canceled,
                actor=actor,
                cause=f"canceled by {actor}; the run did not confirm its exit",
                message="canceled (the run did not confirm its exit)",
                run_values={
                    "state": "canceled",
                    "reason": "exit not confirmed",
                    "ended_at": utcnow(),
                },
            )
        if run.runner is not None:
            run.runner.cancel()
        self._on_run_end(live)

    async def _signal(self, live: LiveTask, sig: str) -> None:
        run = live.run
        assert run is not None and run.session_id is not None
        try:
            await self.sessions.signal(run.session_id, sig, actor=run.cancel_actor or SYSTEM_ACTOR)
        except (SessionEnded, SessionNotFound):
            pass
        except SessionError as exc:
            log.warning("signal %s to task %s failed: %s", sig, live.id, exc)


BUDGET_WORDS = {
    "timeout": ("timeout_seconds", "went past its {} s wall-clock budget"),
    "memory": ("memory_mib", "hit its {} MiB memory budget"),
    "pids": ("pids", "hit its budget of {} processes"),
    "output-limit": ("output_bytes", "wrote more than its {} output bytes"),
}


def exceeded_message(reason: str, budget: dict[str, object] | None) -> str:
    """`<reason>: the run …` — the final status message of a run its budget ended."""
    name, text = BUDGET_WORDS.get(reason, ("", "exceeded its budget"))
    value = (budget or {}).get(name) if name else None
    if value is None:
        return f"{reason}: the run exceeded its budget"
    shown = f"{value:g}" if isinstance(value, float) else str(value)
    return f"{reason}: the run {text.format(shown)}"


def _usage_values(status: ExitStatus) -> dict[str, object]:
    """The run row's columns for its budget outcome and usage."""
    out: dict[str, object] = {"exceeded": status.exceeded or None}
    if status.usage is not None:
        out["cpu_us"] = status.usage.cpu_us
        out["peak_memory_bytes"] = status.usage.peak_memory_bytes
    return out


async def _wait(event: asyncio.Event, seconds: float) -> bool:
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
        return True
    except TimeoutError:
        return event.is_set()


def _working_step(run: RunState, note: str = "") -> Step:
    """`submitted -> working` for a run whose session is open (`run.session_id`)."""
    sid = run.session_id
    return Step(
        TaskState.working,
        actor=SYSTEM_ACTOR,
        cause=f"run {run.id} started in session {sid}" + (f" {note}" if note else ""),
        metadata={"sessionId": sid, "runId": run.id},
        run_values={
            "session_id": sid,
            "state": "running",
            "started_at": utcnow(),
            "budget": run.budget,
        },
    )
