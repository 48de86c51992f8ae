"""A rollout: one agent bundle to a list of instances, one at a time, as an operation.

For each instance the rollout

1. skips it, saying why, when its agent is not connected, runs the bundle already, is being
   upgraded by another rollout, or cannot take a bundle (`agent_bundle` is not among its
   stream kinds: an agent without a session keeper would end its sessions to restart);
2. notes the sessions the server holds running there, sends the bundle on a stream of kind
   `agent_bundle` (the agent checks its size and SHA-256 and unpacks it) and waits for its close;
3. waits for the agent's next worker to link: the instance is `upgraded` when that worker
   runs the bundle, heard the server (a heartbeat) and still holds every session noted before;
   `rolled-back` when the agent came back on the bundle it ran before, naming why
   (`bundle_problem`); `failed` when neither happened within the trial's seconds and a margin.

The first instance that is not upgraded ends the rollout (`failed`, naming the instance and
why): the rest keep what they run. Each outcome is audited and published (`agent.upgraded`,
`agent.rolled_back`); the operation's result lists every instance's outcome.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import select

from agentic_sandbox.broker.agentlink import (
    AgentBundleResult,
    AgentBundleSpec,
    AgentConnection,
    AgentRegistry,
    LinkClosed,
    StreamError,
    StreamLost,
    TooManyStreams,
)
from agentic_sandbox.broker.operations import OperationFailed, OperationRunner, Progress
from agentic_sandbox.broker.services import Services
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.broker.upgrades.bundles import StoredBundle

log = logging.getLogger(__name__)

KIND = "agent_bundle"
FRAME = 256 * 1024
SEND_TIMEOUT = 120.0  # the bundle sent, checked and unpacked (a TCG guest is slow)
MARGIN = 30.0  # past the trial: the keeper's hand-over and the old worker's link back
POLL = 0.2


@dataclass
class Outcome:
    instance_id: str
    state: str  # upgraded, skipped, rolled-back, failed
    reason: str = ""
    seconds: float = 0.0
    version: str = ""  # what the agent reports running afterwards
    sessions_kept: int = 0


class Rollouts:
    def __init__(self, svc: Services, registry: AgentRegistry, ops: OperationRunner) -> None:
        self._svc = svc
        self._registry = registry
        self._ops = ops
        self._busy: set[str] = set()  # instances a rollout is upgrading now

    async def start(
        self,
        bundle: StoredBundle,
        instances: Sequence[str] | None,
        trial_seconds: int,
        *,
        owner: str,
        actor: str,
    ) -> m.Operation:
        targets = (
            list(instances) if instances else sorted(c.instance_id for c in self._registry.all())
        )

        async def body(progress: Progress) -> dict[str, Any]:
            return await self._run(progress, bundle, targets, trial_seconds, actor)

        return await self._ops.submit(
            kind="agent-rollout",
            subject_type="agent_bundle",
            subject_id=bundle.digest,
            owner=owner,
            actor=actor,
            body=body,
        )

    async def _run(
        self,
        progress: Progress,
        bundle: StoredBundle,
        targets: list[str],
        trial: int,
        actor: str,
    ) -> dict[str, Any]:
        outcomes: list[Outcome] = []
        summary = {"bundle": bundle.digest, "version": bundle.version}
        for iid in targets:
            progress.stage(f"upgrading {iid}", [asdict(o) for o in outcomes])
            outcome = await self._one(iid, bundle, trial)
            outcomes.append(outcome)
            self._record(outcome, bundle, actor)
            if outcome.state in ("rolled-back", "failed"):
                progress.stages = [asdict(o) for o in outcomes]
                raise OperationFailed(
                    f"upgrading {iid}",
                    f"instance {iid}: {outcome.reason}; the rollout stopped there",
                    {**summary, "instances": [asdict(o) for o in outcomes]},
                )
        progress.stages = [asdict(o) for o in outcomes]
        return {**summary, "instances": [asdict(o) for o in outcomes]}

    def _record(self, o: Outcome, bundle: StoredBundle, actor: str) -> None:
        detail = {"bundle": bundle.digest, "version": bundle.version, "seconds": o.seconds}
        self._svc.audit.record(
            actor,
            "agent.upgrade",
            "instance",
            o.instance_id,
            outcome="ok" if o.state in ("upgraded", "skipped") else "failed",
            cause=f"{o.state}: {o.reason}" if o.reason else o.state,
            detail=detail,
        )
        if o.state in ("upgraded", "rolled-back"):
            conn = self._registry.get(o.instance_id)
            self._svc.events.publish(
                "agent.upgraded" if o.state == "upgraded" else "agent.rolled_back",
                actor=actor,
                instance_id=o.instance_id,
                owner=conn.owner if conn is not None else None,
                data={**detail, "reason": o.reason, "sessions_kept": o.sessions_kept},
            )

    # ---- one instance -------------------------------------------------------------------------
    async def _one(self, iid: str, bundle: StoredBundle, trial: int) -> Outcome:
        conn = self._registry.get(iid)
        if conn is None or not conn.ready:
            return Outcome(iid, "skipped", "its agent is not connected")
        if conn.info.agent_bundle == bundle.digest:
            return Outcome(iid, "skipped", "it runs this bundle already", version=bundle.version)
        if KIND not in conn.info.stream_kinds:
            return Outcome(
                iid,
                "skipped",
                "its agent cannot take a bundle (it runs without a session keeper, which a "
                f"restart that keeps the sessions needs, or predates upgrades: "
                f"{conn.info.agent_version or 'unknown'})",
            )
        if iid in self._busy:
            return Outcome(iid, "skipped", "another rollout is upgrading it")
        self._busy.add(iid)
        started = time.monotonic()
        try:
            outcome = await self._upgrade(conn, bundle, trial)
        finally:
            self._busy.discard(iid)
        outcome.seconds = round(time.monotonic() - started, 2)
        return outcome

    async def _upgrade(self, conn: AgentConnection, bundle: StoredBundle, trial: int) -> Outcome:
        iid = conn.instance_id
        before = await self._running_sessions(iid, conn.incarnation)
        old_run = conn.info.agent_run_id
        try:
            result = await self._send(conn, bundle, trial)
        except (LinkClosed, StreamLost, TooManyStreams) as exc:
            return Outcome(iid, "failed", f"the bundle could not be sent: {exc}")
        except StreamError as exc:
            return Outcome(iid, "failed", f"its agent refused the bundle: {exc.code}: {exc}")
        except TimeoutError:
            return Outcome(
                iid, "failed", f"its agent did not take the bundle within {SEND_TIMEOUT:.0f} s"
            )
        if result.digest != bundle.digest:
            return Outcome(iid, "failed", "its agent answered for another bundle")
        if not result.restarting:
            return Outcome(iid, "skipped", "it runs this bundle already", version=bundle.version)
        return await self._await_worker(iid, old_run, bundle, trial, before)

    async def _send(
        self, conn: AgentConnection, bundle: StoredBundle, trial: int
    ) -> AgentBundleResult:
        stream = conn.streams.open(AgentBundleSpec(bundle.digest, bundle.size, trial))
        loop = asyncio.get_running_loop()
        stream.expire_at(loop.time() + SEND_TIMEOUT, "the agent did not take the bundle in time")
        try:
            await stream.started()
            try:
                await stream.write(0, bundle.data, chunk=FRAME)
                await stream.end(0)
            except StreamLost as exc:
                if exc.code != "closed":
                    raise  # (closed: the agent answered early; its close says why)
            result = await stream.result()
        except StreamLost as exc:
            if exc.code == "timeout":
                raise TimeoutError from None
            raise
        finally:
            stream.cancel("canceled", "the server stopped waiting")
        if not isinstance(result, AgentBundleResult):
            raise StreamError("agent-error", "the agent closed with another kind's result")
        return result

    async def _await_worker(
        self, iid: str, old_run: str, bundle: StoredBundle, trial: int, before: set[str]
    ) -> Outcome:
        deadline = time.monotonic() + trial + MARGIN
        while time.monotonic() < deadline:
            conn = self._registry.get(iid)
            if conn is not None and conn.ready and conn.info.agent_run_id != old_run:
                info = conn.info
                if info.agent_bundle == bundle.digest:
                    heard = conn.last_heartbeat_at
                    if heard is not None and heard >= conn.connected_at:
                        return await self._check_sessions(iid, conn, bundle, before)
                elif bundle.digest in info.bundle_problem:
                    return Outcome(
                        iid, "rolled-back", info.bundle_problem, version=info.agent_version
                    )
            await asyncio.sleep(POLL)
        conn = self._registry.get(iid)
        now = (
            f"it runs {conn.info.agent_bundle[:12] or 'its installed agent'}"
            if conn is not None and conn.ready
            else "its agent is not connected"
        )
        return Outcome(
            iid,
            "failed",
            f"no agent on the bundle linked and heard the server within {trial + MARGIN:.0f} s "
            f"({now})",
        )

    async def _check_sessions(
        self, iid: str, conn: AgentConnection, bundle: StoredBundle, before: set[str]
    ) -> Outcome:
        missing = before - conn.info.session_ids
        if missing:  # gone from the agent: fine only when they exited on their own meanwhile
            async with self._svc.db.session() as s:
                rows = (
                    await s.execute(
                        select(m.Session.id, m.Session.state).where(m.Session.id.in_(missing))
                    )
                ).all()
            missing = {sid for sid, state in rows if state != "exited"}
        version = conn.info.agent_version
        if missing:
            names = ", ".join(sorted(missing)[:5])
            return Outcome(
                iid,
                "failed",
                f"its agent runs the bundle but lost {len(missing)} sessions ({names})",
                version=version,
            )
        return Outcome(iid, "upgraded", version=version, sessions_kept=len(before))

    async def _running_sessions(self, iid: str, incarnation: str) -> set[str]:
        async with self._svc.db.session() as s:
            rows = await s.scalars(
                select(m.Session.id).where(
                    m.Session.instance_id == iid,
                    m.Session.incarnation == incarnation,
                    m.Session.state == "running",
                )
            )
            return set(rows.all())
