"""The egress proxy in the server: per-instance policy, limits, and the record of every attempt.

**Who is asking.** A guest's proxy connections ride its agent link as streams of kind
`egress` (the agent listens on the guest's loopback for its tools and opens one stream per
connection). The instance and incarnation are the link's — the ones its mutual-TLS
certificate names — never anything the guest says: there is no per-connection claim to
check, and a guest cannot speak for another instance. (A chardev guest forward carries one
connection at a time, which a proxy cannot share; the link's streams are multiplexed.)

**Policy.** An instance's policy is its row's `network_policy` and its allowlist in
`spec.egress` (from the loadout and the create request, replaced by the admin API). Only
`allowlist` instances are served; the answer is cached per incarnation and replaced at once
by `replace`, so a change applies to the next connection.

**Brokered credentials.** An instance's `spec.egress.credentials` name secrets of its owner
and the destinations they are for. A `CONNECT` to such a destination is intercepted
(`proxy.py`): the proxy shows the guest a leaf of the incarnation's CA (`interception.py`, in
memory only, destroyed when the incarnation ends; sent to the agent at every registration by
the component) and sets the header from the secret's value, read from the vault for that
connection only. The record names the secret (`credential`), never its value.

**Whose run.** A connection is counted to one run, for that run's egress bytes:
- an **exec**, when its request names the exec's token: the server mints one per exec
  (`begin_exec`, a random 128-bit value kept only in memory, for that instance's incarnation),
  the agent puts it in the exec's proxy URL as userinfo (`http://run:<token>@127.0.0.1:3128`:
  curl, pip, git, npm and urllib send it as `Proxy-Authorization: Basic`, the proxy reads
  it and never forwards it), and the exec's answer gets the bytes of its connections
  (`end_exec`, which waits a moment for those whose guest side its exit closed);
- else the **task run** running on the instance then (`current_run`), as before.
The proxy on the host cannot see which guest process opened a connection (the guest's tools
reach the agent's loopback listener, and the agent relays bytes); the token is the run
telling it, through the one setting every tool already reads. It is accounting only, never a
permission: a missing, malformed or unknown token (or another instance's) changes no verdict
and falls back to the task run. A guest can misreport its own runs' bytes this way (a process
can use another exec's URL), never another instance's; the audit rows stay the per-connection
truth.

**Record.** Each attempt, allowed or not, is one audit row (`egress.connect`, outcome
ok/denied/failed, the verdict and the rest in its detail) and one event, `egress.allowed`
(when it ends, with bytes and duration), `egress.denied` or `egress.failed`, counted in
`/metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select

from agentic_sandbox.broker.egress.interception import CAEnded, IncarnationCA, upstream_context
from agentic_sandbox.broker.egress.limits import InstanceLimits
from agentic_sandbox.broker.egress.proxy import (
    Brokered,
    BrokerUnavailable,
    Opener,
    Outcome,
    Pipe,
    ProxyConnection,
    open_tcp,
)
from agentic_sandbox.broker.egress.resolver import HostsFileResolver, Resolver, SystemResolver
from agentic_sandbox.broker.services import Services
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.provision.egress_rules import EgressConfig

log = logging.getLogger(__name__)

VERDICTS = ("allowed", "denied", "failed")
MAX_RUN_BYTES = 10_000  # task runs whose egress bytes are kept (the latest)
RUN_CACHE_SECONDS = 1.0  # an instance's running task is looked up at most this often
MAX_EXEC_ACCOUNTS = 10_000  # execs running at once whose connections are counted (the oldest go)
EXEC_SETTLE_SECONDS = 2.0  # an ended exec waits this long at most for its connections to end


@dataclass(frozen=True)
class Requester:
    """Whose connection this is: from the agent link, never from the guest."""

    instance_id: str
    incarnation: str
    owner: str = ""
    client: str = ""  # the guest-side peer the agent reports (informational only)


@dataclass
class ExecAccount:
    """The egress of one exec while it runs: its connections' bytes (up, down) as they end."""

    exec_id: str
    instance_id: str
    incarnation: str
    up: int = 0
    down: int = 0
    connections: int = 0  # counted to it so far
    open: int = 0  # of those, still open
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # set while none is open

    def __post_init__(self) -> None:
        self.settled.set()


@dataclass
class Policy:
    incarnation: str
    network: str
    config: EgressConfig

    @property
    def effective(self) -> EgressConfig | None:
        return self.config if self.network == "allowlist" else None


def brokered_hosts(policy: Policy | None) -> frozenset[str]:
    """The destinations the incarnation's CA signs for: its brokered credentials' hosts."""
    config = policy.effective if policy is not None else None
    return config.brokered_hosts() if config is not None else frozenset()


def config_of(spec: dict[str, Any] | None) -> EgressConfig:
    raw = (spec or {}).get("egress")
    return EgressConfig.model_validate(raw) if isinstance(raw, dict) else EgressConfig()


class EgressService:
    def __init__(
        self,
        svc: Services,
        *,
        resolver: Resolver | None = None,
        opener: Opener = open_tcp,
    ) -> None:
        self.svc = svc
        hosts = svc.settings.egress_hosts_file
        self.resolver: Resolver = resolver or (
            HostsFileResolver(hosts) if hosts is not None else SystemResolver()
        )
        self._open = opener
        self._policies: dict[str, Policy] = {}
        self._limits: dict[tuple[str, str], InstanceLimits] = {}
        self.connections: Counter[tuple[str, str]] = Counter()  # (verdict, reason)
        self.bytes: Counter[str] = Counter()  # up, down
        self._runs: dict[tuple[str, str], tuple[float, tuple[str, str] | None]] = {}
        # bytes (up, down) of the ended connections attributed to each task run, newest last
        self._run_bytes: OrderedDict[str, list[int]] = OrderedDict()
        self._cas: dict[tuple[str, str], IncarnationCA] = {}
        self._execs: OrderedDict[str, ExecAccount] = OrderedDict()  # by token
        # told (instance, incarnation) when a policy change made a new CA (sent to the guest)
        self.on_new_ca: Callable[[str, str], None] | None = None
        self.upstream = upstream_context(svc.settings.egress_upstream_ca_file)
        svc.metrics.provide_counter(
            "sandbox_egress_connections",
            "Egress proxy connection attempts by verdict and reason",
            ("verdict", "reason"),
            lambda: {k: float(v) for k, v in self.connections.items()},
        )
        svc.metrics.provide_counter(
            "sandbox_egress_bytes",
            "Bytes through the egress proxy, by direction as the guest sees it (up: sent)",
            ("direction",),
            lambda: {(k,): float(v) for k, v in self.bytes.items()},
        )
        svc.metrics.provide(
            "sandbox_egress_active_connections",
            "Egress proxy connections open now",
            (),
            lambda: {(): float(sum(lim.active for lim in self._limits.values()))},
        )

    # ---- policy -------------------------------------------------------------------------------
    async def policy(self, instance_id: str, incarnation: str) -> Policy | None:
        cached = self._policies.get(instance_id)
        if cached is not None and cached.incarnation == incarnation:
            return cached
        async with self.svc.db.session() as s:
            row = await s.get(m.Instance, instance_id)
        if row is None or row.deleted_at is not None or row.incarnation != incarnation:
            return None
        try:
            config = config_of(row.spec)
        except ValueError as exc:
            log.warning("instance %s has an unusable egress allowlist: %s", instance_id, exc)
            config = EgressConfig()
        policy = Policy(row.incarnation, row.network_policy, config)
        self._policies[instance_id] = policy
        return policy

    def replace(
        self, instance_id: str, incarnation: str, network: str, config: EgressConfig
    ) -> None:
        """The instance's new policy, effective for its next connection (and a new CA when
        the brokered destinations changed: the old one's name constraints do not fit)."""
        policy = self._policies[instance_id] = Policy(incarnation, network, config)
        ca = self._cas.get((instance_id, incarnation))
        if ca is not None and not ca.ended and ca.names != brokered_hosts(policy):
            self.ca_for(instance_id, incarnation, names=brokered_hosts(policy))
            if self.on_new_ca is not None:
                self.on_new_ca(instance_id, incarnation)
        lim = self._limits.get((instance_id, incarnation))
        if lim is not None:
            lim.configure(config.limits.max_connections, config.limits.bandwidth_bytes_per_second)

    def end_incarnation(self, instance_id: str, incarnation: str) -> None:
        cached = self._policies.get(instance_id)
        if cached is not None and cached.incarnation == incarnation:
            del self._policies[instance_id]
        self._limits.pop((instance_id, incarnation), None)
        self._runs.pop((instance_id, incarnation), None)
        ca = self._cas.pop((instance_id, incarnation), None)
        if ca is not None:
            ca.destroy()

    # ---- the incarnation's CA -----------------------------------------------------------------
    def ca_for(
        self,
        instance_id: str,
        incarnation: str,
        *,
        names: frozenset[str],
        renew: bool = False,
    ) -> IncarnationCA:
        """The incarnation's CA for the brokered destinations `names`, made on first use and
        again when `names` changed (`renew`: a new one when this one is near its end — what a
        registration asks, since it sends the CA to the guest)."""
        key = (instance_id, incarnation)
        ca = self._cas.get(key)
        if ca is None or ca.ended or ca.names != names or (renew and not ca.fresh()):
            if ca is not None:
                ca.destroy()
            ca = self._cas[key] = IncarnationCA(instance_id, incarnation, names=names)
        return ca

    async def current_ca(
        self, instance_id: str, incarnation: str, *, renew: bool = False
    ) -> IncarnationCA:
        """The CA for the incarnation's brokered destinations now (what the guest is sent)."""
        policy = await self.policy(instance_id, incarnation)
        return self.ca_for(instance_id, incarnation, names=brokered_hosts(policy), renew=renew)

    async def brokered(self, who: Requester, host: str, port: int) -> Brokered | None:
        """How to serve a CONNECT to host:port for `who`: None (a plain tunnel) unless the
        destination has a brokered credential now."""
        live = self._policies.get(who.instance_id)
        if live is None or live.incarnation != who.incarnation or live.effective is None:
            return None
        cred = live.effective.credential_for(host, port)
        if cred is None:
            return None
        value = await self.svc.vault.value_of(who.owner, cred.secret)
        if value is None:
            raise BrokerUnavailable(
                "credential-unavailable",
                f"{host}:{port} has the brokered credential {cred.secret!r}, "
                "which is not a secret of the instance's owner (any more)",
            )
        try:
            ca = self.ca_for(who.instance_id, who.incarnation, names=brokered_hosts(live))
            guest_context = ca.server_context(host)
        except CAEnded:
            raise BrokerUnavailable("credential-unavailable", "the incarnation ended") from None
        return Brokered(
            name=cred.secret,
            header=cred.header.lower().encode("ascii"),
            value=cred.header_value(value).encode("utf-8"),
            guest_context=guest_context,
            upstream_context=self.upstream,
        )

    def _limits_for(self, who: Requester, config: EgressConfig | None) -> InstanceLimits:
        key = (who.instance_id, who.incarnation)
        lim = self._limits.get(key)
        if lim is None:
            limits = config.limits if config is not None else EgressConfig().limits
            lim = self._limits[key] = InstanceLimits(
                limits.max_connections, limits.bandwidth_bytes_per_second
            )
        return lim

    async def current_run(self, who: Requester) -> tuple[str, str] | None:
        """(task id, run id) of the task running on the instance now, if one is."""
        key = (who.instance_id, who.incarnation)
        now = time.monotonic()
        cached = self._runs.get(key)
        if cached is not None and now - cached[0] < RUN_CACHE_SECONDS:
            return cached[1]
        async with self.svc.db.session() as s:
            row = (
                await s.execute(
                    select(m.Task.id, m.Run.id)
                    .join(m.Run, m.Run.task_id == m.Task.id)
                    .where(
                        m.Task.instance_id == who.instance_id,
                        m.Task.incarnation == who.incarnation,
                        m.Run.state == "running",
                    )
                    .order_by(m.Run.started_at.desc())
                    .limit(1)
                )
            ).first()
        found = (str(row[0]), str(row[1])) if row is not None else None
        if len(self._runs) > 10_000:
            self._runs.clear()
        self._runs[key] = (now, found)
        return found

    def run_bytes(self, run_id: str) -> tuple[int, int]:
        """Bytes (up to the destinations, down from them) of the egress connections made while
        task run `run_id` ran on its instance, counted as each connection ends (one still open
        when the run ends counts in the audit row it gets then, not here). Kept for the
        latest `MAX_RUN_BYTES` runs."""
        got = self._run_bytes.get(run_id)
        return (got[0], got[1]) if got is not None else (0, 0)

    def _count_for_run(self, run_id: str, up: int, down: int) -> None:
        got = self._run_bytes.get(run_id)
        if got is None:
            got = self._run_bytes[run_id] = [0, 0]
            while len(self._run_bytes) > MAX_RUN_BYTES:
                self._run_bytes.popitem(last=False)
        got[0] += up
        got[1] += down

    # ---- execs ----------------------------------------------------------------------------
    def begin_exec(self, instance_id: str, incarnation: str, exec_id: str) -> str:
        """A new token for exec `exec_id` of that incarnation: connections that name it are
        counted to the exec until `end_exec`."""
        token = secrets.token_hex(16)
        self._execs[token] = ExecAccount(exec_id, instance_id, incarnation)
        while len(self._execs) > MAX_EXEC_ACCOUNTS:
            self._execs.popitem(last=False)
        return token

    async def end_exec(self, token: str, settle: float = EXEC_SETTLE_SECONDS) -> tuple[int, int]:
        """Bytes (up, down) of the exec's connections; its token is forgotten. Connections still
        open wait up to `settle` seconds (the exec's exit closes their guest side; the rest
        of the relay ends at once); one open longer (a process the exec left running) counts
        in its audit row only."""
        account = self._execs.get(token)
        if account is None:
            return (0, 0)
        try:
            if not account.settled.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(settle):
                        await account.settled.wait()
        finally:
            self._execs.pop(token, None)
        return (account.up, account.down)

    def drop_exec(self, token: str) -> None:
        """Forget an exec that did not run to its end."""
        self._execs.pop(token, None)

    def claim_exec(self, who: Requester, token: str) -> ExecAccount | None:
        """The exec a connection's run token names, if it is a live exec of `who` (then the
        connection is open in its account until `record`)."""
        account = self._execs.get(token) if token else None
        if (
            account is None
            or account.instance_id != who.instance_id
            or account.incarnation != who.incarnation
        ):
            return None
        account.open += 1
        account.settled.clear()
        return account

    # ---- one connection -----------------------------------------------------------------------
    async def serve(self, pipe: Pipe, who: Requester) -> Outcome:
        """Proxy one guest connection and record it."""
        run = await self.current_run(who)
        policy = await self.policy(who.instance_id, who.incarnation)
        config = policy.effective if policy is not None else None
        limits = self._limits_for(who, config)

        def current() -> EgressConfig | None:
            live = self._policies.get(who.instance_id)
            if live is None or live.incarnation != who.incarnation:
                return None
            return live.effective

        async def broker(host: str, port: int) -> Brokered | None:
            return await self.brokered(who, host, port)

        account: ExecAccount | None = None

        def on_request(out: Outcome) -> None:
            nonlocal account
            account = self.claim_exec(who, out.account)

        conn = ProxyConnection(
            pipe,
            config=current,
            resolver=self.resolver,
            limits=limits,
            opener=self._open,
            broker=broker,
            on_request=on_request,
        )
        try:
            return await conn.run()
        except Exception as exc:
            if not conn.outcome.detail:
                conn.outcome.detail = f"the guest's side ended: {type(exc).__name__}: {exc}"
            raise
        finally:
            self.record(who, conn.outcome, run, account)

    def record(
        self,
        who: Requester,
        out: Outcome,
        run: tuple[str, str] | None = None,
        account: ExecAccount | None = None,
    ) -> None:
        verdict = out.verdict if out.verdict in VERDICTS else "failed"
        self.connections[(verdict, out.reason or "ok")] += 1
        self.bytes["up"] += out.bytes_up
        self.bytes["down"] += out.bytes_down
        detail: dict[str, Any] = {
            "incarnation": who.incarnation,
            "kind": out.kind,
            "method": out.method,
            "host": out.host[:253],
            "port": out.port,
            "address": out.address,
            "verdict": verdict,
            "reason": out.reason,
            "status": out.status,
            "bytes_up": out.bytes_up,
            "bytes_down": out.bytes_down,
            "duration_ms": round(out.duration * 1000, 3),
        }
        if out.credential:
            detail["credential"] = out.credential  # the secret's name: its header was added
        if account is not None:  # the exec that named its token: its bytes, not the task's
            detail["exec_id"] = account.exec_id
            account.up += out.bytes_up
            account.down += out.bytes_down
            account.connections += 1
            account.open -= 1
            if account.open <= 0:
                account.settled.set()
        elif run is not None:
            detail["task_id"], detail["run_id"] = run
            self._count_for_run(run[1], out.bytes_up, out.bytes_down)
        if out.detail:
            detail["detail"] = out.detail[:500]
        target = f"{out.host[:200]}:{out.port}" if out.host else who.instance_id
        self.svc.audit.record(
            f"agent:{who.instance_id}",
            "egress.connect",
            "instance",
            who.instance_id,
            outcome="ok" if verdict == "allowed" else verdict,
            cause=f"{target}: {out.reason or 'ok'}",
            detail=detail,
        )
        self.svc.events.publish(
            f"egress.{verdict}",
            actor=f"agent:{who.instance_id}",
            instance_id=who.instance_id,
            owner=who.owner or None,
            task_id=run[0] if run is not None and account is None else None,
            data=detail,
        )
