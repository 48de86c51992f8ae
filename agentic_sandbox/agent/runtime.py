"""The agent's life: enroll once, hold one link to the server, run sessions, follow its seed.

- `credentials.py` keeps the key and certificate, `enrollment.py` enrolls and renews,
  `channels.py` dials the server (directly, or through the guest link gateway), `link.py` is one
  connection, `seedwatch.py` notices a new seed, `guard.py` keeps the guest's forward the
  agent's own, `session.py` is one PTY with its ring and flow state.
- This module holds the sessions (open, input, resize, signal, close as the server asks), what a
  registration reports and resumes, and the loop that (re)connects. Byte streams (exec runs,
  file transfers, port connections, egress) live in `streams.py` (the table, flow control) and
  their kinds' modules (`exec.py`, budgets in `cgroups.py`; `files.py`; `ports.py`; `egress.py`).
- `next_message()` decides what the link sends next: the outbox and stream control (accepts,
  credits) first, then session output, then stream data — one chunk at a time, and a stream
  chunk after every bulk session message, so an echo never waits behind more than one stream
  chunk and neither kind starves the other.

Reconnects use jittered exponential backoff: up to `max_backoff` (default 30 s) when the server
refused the agent, at most 1 s while it is merely unreachable (a retry that reaches nothing
costs nothing, and the agent must be back within a second or two of the server). Sessions keep
running while the link is down; their output waits in their rings (and the PTYs block once a
ring is full of unacknowledged output).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import random
import socket
import time
import uuid
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import grpc

from agentic_sandbox.agent import cgroups, egress_trust, entropy, files, identity, pki, upgrade
from agentic_sandbox.agent import egress as agent_egress
from agentic_sandbox.agent.channels import connect_channel
from agentic_sandbox.agent.config import AgentConfig, default_enroll
from agentic_sandbox.agent.controls import Controls, leader_hint
from agentic_sandbox.agent.credentials import Credentials
from agentic_sandbox.agent.enrollment import EnrollmentFailed, enroll, make_keys, renew
from agentic_sandbox.agent.exec import ExecContext, ExecRun
from agentic_sandbox.agent.guard import guard_forward
from agentic_sandbox.agent.keeper import Adopted, KeeperLink
from agentic_sandbox.agent.link import DEFAULT_HEARTBEAT, Link
from agentic_sandbox.agent.paths import FileRefused, refusal
from agentic_sandbox.agent.ports import PortRelay
from agentic_sandbox.agent.seedwatch import SeedWatcher
from agentic_sandbox.agent.serial_link import SerialBridge
from agentic_sandbox.agent.session import BATCH_BYTES, PtySession, SpawnError
from agentic_sandbox.agent.streams import Opener, Stream, StreamHandler, StreamTable
from agentic_sandbox.agent.sysinfo import SysInfo
from agentic_sandbox.proto import PROTOCOL, PROTOCOL_METADATA
from agentic_sandbox.proto import agent_pb2 as pb
from agentic_sandbox.proto.seed_record import NO_SPARE_KEY, SPARE_KEY_READY

log = logging.getLogger("agent")

UNREACHABLE_BACKOFF = 1.0  # the longest wait between tries while the server does not answer
STANDBY_WARM_UP_SECONDS = 10.0  # at most, for a standing-by member's warm-up connection
SSH_KEYS_IN_PAUSES_OF = 5.0  # seconds: a backoff at least this long makes due SSH host keys
SIGNAL_NAMES = {
    pb.SIGNAL_INT: "INT",
    pb.SIGNAL_TERM: "TERM",
    pb.SIGNAL_KILL: "KILL",
    pb.SIGNAL_HUP: "HUP",
}
REFUSED = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)
MAX_SESSION_DIRS = 8  # `OpenSession.make_dirs` at most (more: the open is refused)
BULK_BYTES = BATCH_BYTES // 4  # a session message this large is a flood's: a stream gets a turn


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def protocol_refusal(exc: grpc.aio.AioRpcError) -> str | None:
    """The protocols the server speaks ("1-2") when it refused this agent's, else None. The
    agent goes on retrying at its longest backoff: an upgrade on either side ends it."""
    if exc.code() is not grpc.StatusCode.FAILED_PRECONDITION:
        return None
    for key, value in exc.trailing_metadata() or ():
        if key == PROTOCOL_METADATA:
            return value.decode() if isinstance(value, bytes) else str(value)
    return None


class Backoff:
    """Jittered exponential backoff: each delay is uniform in [d/2, d], d doubling to max."""

    def __init__(self, initial: float, maximum: float) -> None:
        self.initial = initial
        self.maximum = maximum
        self._next = initial

    def reset(self) -> None:
        self._next = self.initial

    def delay(self, cap: float | None = None) -> float:
        d = self._next if cap is None else min(self._next, cap)
        self._next = min(self.maximum, self._next * 2)
        return random.uniform(d / 2, d)


class AgentRuntime:
    def __init__(self, config: AgentConfig) -> None:
        self.cfg = config
        self.creds = Credentials(config)
        self.sessions: dict[str, PtySession] = {}
        self.outbox: deque[pb.AgentMessage] = deque()
        self.run_id = uuid.uuid4().hex[:16]
        self.heartbeat_interval = DEFAULT_HEARTBEAT
        self.sysinfo = SysInfo()
        self.backoff = Backoff(config.initial_backoff, config.max_backoff)
        self.controls = Controls(config.control_addresses())
        self.keeper = KeeperLink.from_env()  # holds the sessions across worker restarts
        self.handing_over = False  # a planned restart: leave the sessions to the keeper
        self.wake_event = asyncio.Event()
        self.seeds = SeedWatcher()
        self._keys: asyncio.Future[tuple[bytes, bytes]] | None = None  # a restored guest's
        # a key made while standing by in a warm pool, for the next seed only (`_stand_by`)
        self._spare: asyncio.Future[tuple[bytes, bytes]] | None = None
        self._spare_for = ""  # the member id it was made as: only a seed naming it may use it
        self._warming: asyncio.Task[None] | None = None  # the stand-by's warm-up (`_warm_up`)
        self.link: Link | None = None
        self._seed_changed = asyncio.Event()
        self._background: set[asyncio.Future[None]] = set()
        self._ssh_keys_due = False  # new SSH host keys owed to a taken-on identity
        self._guarded: tuple[str, ...] = ()
        self.cgroups = cgroups.Cgroups(problem="not detected yet")
        openers: dict[str, Opener] = {"exec": self._open_exec}
        openers.update(dict.fromkeys(files.KINDS, self._open_file))
        openers["port"] = PortRelay.open
        if self.keeper is not None:  # only a kept agent can restart without ending sessions
            openers[upgrade.KIND] = functools.partial(
                upgrade.open_bundle_stream,
                config.state_dir / "bundles",
                self._bundle_staged,
                self._background,
            )
        self.running = upgrade.running()
        self.bundle_problem = upgrade.bundle_problem()
        self._main: asyncio.Task[None] | None = None
        self._said_healthy = False
        if config.egress_ca_file:
            openers["egress_trust"] = functools.partial(
                egress_trust.open_trust_stream,
                config.egress_ca_file,
                config.egress_ca_bundle,
                self._background,
            )
        self.streams = StreamTable(openers, wake=self.wake, max_streams=config.max_streams)
        self._stream_turn = False
        # sessions and execs reach the egress proxy without a login shell's profile
        self.proxy_env = (
            agent_egress.proxy_env(config.egress_listen) if config.egress_listen else {}
        )

    @property
    def connected(self) -> bool:
        return self.link is not None and self.link.up

    # ================================================================= sessions
    def wake(self) -> None:
        self.wake_event.set()

    def _opened(self, sid: str, *, pid: int = 0, error: str = "") -> pb.AgentMessage:
        return pb.AgentMessage(
            opened=pb.SessionOpened(session_id=sid, ok=not error, pid=pid, error=error)
        )

    def _open(self, msg: pb.OpenSession) -> pb.AgentMessage:
        sid = msg.session_id
        if sid in self.sessions:
            return self._opened(sid, pid=self.sessions[sid].pid)
        if sum(1 for s in self.sessions.values() if not s.finished) >= self.cfg.max_sessions:
            return self._opened(
                sid, error=f"this agent runs at most {self.cfg.max_sessions} sessions"
            )
        try:
            self._make_dirs(msg.make_dirs, msg.user)
        except FileRefused as exc:
            log.warning("session %s could not start: %s", sid, exc.message)
            return self._opened(sid, error=exc.message)
        try:
            sess = PtySession.spawn(
                sid,
                command=list(msg.command),
                cols=msg.cols or 80,
                rows=msg.rows or 24,
                env={**self.proxy_env, **dict(msg.env)},
                cwd=msg.cwd,
                user=msg.user or self.cfg.default_user,
                ring_bytes=self.cfg.ring_bytes,
                task_id=msg.task_id,
                on_output=self.wake,
                on_finish=self.wake,
                budget=msg.budget if msg.HasField("budget") else None,
                cgroups=self.cgroups,
                keeper=self.keeper,
            )
        except SpawnError as exc:
            log.warning("session %s could not start: %s", sid, exc)
            return self._opened(sid, error=str(exc))
        sess.list_on_exit = msg.list_on_exit
        self.sessions[sid] = sess
        log.info(
            "session %s started (pid %d, %s)",
            sid,
            sess.pid,
            sess.enforcement,
            extra={"session_id": sid, "pid": sess.pid},
        )
        return self._opened(sid, pid=sess.pid)

    def _make_dirs(self, paths: Sequence[str], user: str) -> None:
        """`OpenSession.make_dirs`, with their missing parents, owned by `user` (the session's
        asked user; "": the agent's default, as a `file_mkdir` without an owner): what such a
        stream would make, with the same checks (absolute, no `..`, symlinks not followed) and
        any failure a refusal naming the path. On the loop, as the spawn's own user lookup and
        fork are: local directories, made in well under a millisecond."""
        if len(paths) > MAX_SESSION_DIRS:
            raise FileRefused(
                "bad-path", f"{len(paths)} directories to make (at most {MAX_SESSION_DIRS})"
            )
        ctx = files.FilesContext(self.cfg.default_user)
        for path in paths:
            try:
                files.make_dir(ctx, pb.FileMkdir(path=path, parents=True, owner=user))
            except OSError as exc:
                raise refusal(exc, path) from None

    def _open_exec(
        self, stream: Stream, msg: pb.StreamOpen
    ) -> tuple[StreamHandler, pb.StreamAccept]:
        ctx = ExecContext(
            self.cgroups, self.cfg.default_user, self.proxy_env, self.cfg.egress_listen
        )
        return ExecRun.open(ctx, stream, msg)

    def _open_file(
        self, stream: Stream, msg: pb.StreamOpen
    ) -> tuple[StreamHandler, pb.StreamAccept]:
        return files.open_file_stream(files.FilesContext(self.cfg.default_user), stream, msg)

    def _bundle_staged(self, stream: Stream, digest: str, trial: int) -> None:
        """A new bundle is unpacked: have the keeper try it, once the stream's close is out."""
        keeper = self.keeper
        assert keeper is not None

        async def restart() -> None:
            for _ in range(250):  # the close leaves with the next messages
                if stream.detached:
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)  # and gRPC writes it
            keeper.trial(digest, trial)
            log.info("restarting to try agent bundle %s (%d s trial)", digest[:12], trial)
            self.handing_over = True
            if self._main is not None:
                self._main.cancel()

        task = asyncio.ensure_future(restart())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _adopt(self, adopted: list[Adopted]) -> None:
        """Take on the sessions a previous worker left with the keeper (see `keeper.py`)."""
        keeper = self.keeper
        if keeper is None:
            return
        for held in adopted:
            try:
                sess = PtySession.adopt(
                    held, on_output=self.wake, on_finish=self.wake, keeper=keeper
                )
            except (OSError, ValueError) as exc:
                log.error("session %s could not be taken on: %s", held.sid, exc)
                keeper.release(held.sid)
                for fd in (held.master_fd, held.ring_fd):
                    with contextlib.suppress(OSError):
                        os.close(fd)
                continue
            self.sessions[held.sid] = sess
            log.info(
                "session %s taken on from the previous worker (pid %d, output %d..%d)",
                held.sid,
                sess.pid,
                sess.ring.start,
                sess.ring.end,
                extra={"session_id": held.sid},
            )
        asyncio.get_running_loop().add_reader(keeper.fileno(), self._keeper_said)

    def _keeper_said(self) -> None:
        keeper = self.keeper
        assert keeper is not None
        for msg in keeper.notices():
            sess = self.sessions.get(str(msg.get("sid", "")))
            if msg.get("op") == "exited" and sess is not None and sess.adopted:
                sess.exited(dict(msg.get("exit") or {}))
        if not keeper.alive:
            asyncio.get_running_loop().remove_reader(keeper.fileno())
            log.warning("the session keeper is gone; sessions end with this worker")

    def _forget(self, sid: str) -> None:
        sess = self.sessions.pop(sid, None)
        if sess is not None:
            sess.shutdown()

    def _end(self, sid: str, grace: float) -> None:
        """End a session the server no longer wants (forget it when it has exited)."""
        sess = self.sessions.get(sid)
        if sess is None:
            return
        if sess.finished:
            self._forget(sid)
        else:
            sess.close(grace)

    def handle(self, msg: pb.ServerMessage) -> None:
        kind = msg.WhichOneof("body")
        if kind == "input":
            sess = self.sessions.get(msg.input.session_id)
            if sess is not None:
                sess.write_input(msg.input.data)
        elif kind == "stream":
            self.streams.receive(msg.stream)
        elif kind == "ack":
            sess = self.sessions.get(msg.ack.session_id)
            if sess is not None:
                sess.ack(msg.ack.offset)
        elif kind == "open":
            self.outbox.append(self._open(msg.open))
            self.wake()
        elif kind == "resize":
            sess = self.sessions.get(msg.resize.session_id)
            if sess is not None:
                sess.resize(msg.resize.cols, msg.resize.rows)
        elif kind == "signal":
            sess = self.sessions.get(msg.signal.session_id)
            name = SIGNAL_NAMES.get(msg.signal.signal)
            if sess is not None and name is not None:
                sess.send_signal(name)
        elif kind == "heartbeat_ack":
            if not self._said_healthy and self.keeper is not None:
                self._said_healthy = True  # linked and answered: a bundle on trial is kept
                self.keeper.healthy()
            if self.cfg.seed_identity:  # a guest: follow the server's clock
                identity.step_clock(msg.heartbeat_ack.server_time_unix_ms / 1000.0)
        elif kind == "close":
            self._end(msg.close.session_id, msg.close.grace_ms / 1000.0)
        else:
            log.warning("unexpected message from the server: %s", kind)

    # ================================================================= what the link asks
    def register_message(self) -> pb.Register:
        return pb.Register(
            instance_id=self.cfg.instance_id,
            agent_version=self.running.version,
            agent_bundle=self.running.digest,
            bundle_problem=self.bundle_problem,
            hostname=socket.gethostname(),
            boot_id=_boot_id(),
            agent_run_id=self.run_id,
            ring_bytes=self.cfg.ring_bytes,
            sessions=[s.inventory() for s in self.sessions.values()],
            stream_kinds=self.streams.kinds,
            budgets=self.cgroups.support(),
            protocol=PROTOCOL,
            batches=True,
            acks_when_asked=True,
            session_dirs=True,
        )

    def on_registered(self, ack: pb.RegisterAck) -> None:
        self.outbox.clear()
        if ack.heartbeat_interval_ms:
            self.heartbeat_interval = max(0.05, ack.heartbeat_interval_ms / 1000.0)
        resumed = set()
        for r in ack.resume:
            sess = self.sessions.get(r.session_id)
            if sess is None:
                continue
            frm = sess.resume_from(r.from_offset)
            if frm != r.from_offset:
                log.warning(
                    "session %s: server asked for output from %d, resending from %d",
                    sess.id,
                    r.from_offset,
                    frm,
                )
            resumed.add(sess.id)
        closing = set(ack.close)
        for sid in closing:
            self._end(sid, 2.0)
        for sid, sess in list(self.sessions.items()):
            if sid not in resumed and sid not in closing:
                sess.resend_all()  # the server did not mention it: send everything we hold

    def next_message(self, now: float) -> tuple[pb.AgentMessage | None, float | None]:
        """The next message to send, or (None, seconds to wait for a batch to fill)."""
        if self.outbox:
            return self.outbox.popleft(), None
        streams = self.streams
        control = streams.next_control()
        if control is not None:
            return control, None
        if self._stream_turn:
            self._stream_turn = False
            chunk = streams.next_data()
            if chunk is not None:
                return chunk, None
        wait: float | None = None
        for sess in list(self.sessions.values()):
            msg, left = sess.next_message(now)
            if msg is not None:
                if len(msg.output.data) >= BULK_BYTES:
                    self._stream_turn = streams.has_data
                return msg, None
            if left is not None:
                wait = left if wait is None else min(wait, left)
        chunk = streams.next_data()
        if chunk is not None:
            return chunk, None
        return None, wait

    def queue_heartbeat(self, ask: bool) -> None:
        s = self.sysinfo.sample()
        # a bundle on trial is kept once a heartbeat is answered: ask until one is
        ask = ask or (self.keeper is not None and not self._said_healthy)
        # At most one heartbeat waits in the outbox: a slow link gets the newest one (asking
        # when the one it replaces asked).
        for queued in [m for m in self.outbox if m.WhichOneof("body") == "heartbeat"]:
            ask = ask or queued.heartbeat.want_ack
            self.outbox.remove(queued)
        self.outbox.append(
            pb.AgentMessage(
                heartbeat=pb.Heartbeat(
                    time_unix_ms=int(time.time() * 1000),
                    cpu_percent=s.cpu_percent,
                    memory_used_bytes=s.memory_used_bytes,
                    memory_total_bytes=s.memory_total_bytes,
                    disk_used_bytes=s.disk_used_bytes,
                    disk_total_bytes=s.disk_total_bytes,
                    load1=s.load1,
                    load5=s.load5,
                    load15=s.load15,
                    sessions=sum(1 for x in self.sessions.values() if not x.finished),
                    want_ack=ask,
                )
            )
        )
        self.wake()

    # ================================================================= identity (guests)
    async def adopt_seed_identity(self) -> bool:
        """Take on the identity written on the cloud-init seed if it is not ours (a clone or a
        warm-pool hand-off). Returns whether the identity changed."""
        if not self.cfg.seed_identity:
            return False
        identity.unlock_cdrom_trays()
        seed = await self.seeds.check()
        if seed is None or seed.instance_id == self.cfg.instance_id:
            return False
        if seed.standby:
            self._stand_by(seed)
            return True
        log.warning(
            "this guest was restored as instance %s (was %s): taking on its identity",
            seed.instance_id,
            self.cfg.instance_id,
        )
        for sess in list(self.sessions.values()):  # the other instance's sessions
            sess.shutdown()
        self.sessions.clear()
        self.outbox.clear()
        self.creds.forget()
        # first the kernel's random generator, which the save left as every clone's: the key,
        # machine-id and SSH host keys below draw from it (entropy.py)
        self._reseed(seed)
        # the new instance's key: the one this pool member made while it stood by, when the
        # seed is the hand-off made for this very member (`standby_of`), or one made now,
        # while the guest takes on its identity. A key from before a restore is never used
        # otherwise: a memory snapshot taken while it stood by (or before the hand-off's seed
        # was read) restores it into every clone, and a clone's seed names no member.
        self.seeds.standing_by = False
        spare, self._spare = self._spare, None
        spare_for, self._spare_for = self._spare_for, ""
        if self._warming is not None:
            self._warming.cancel()
            self._warming = None
        if self._keys is not None and self._keys is not spare:
            self._keys.cancel()
        failed = spare is not None and spare.done() and (spare.cancelled() or spare.exception())
        if spare is not None and not failed and spare_for and seed.standby_of == spare_for:
            log.info("using the key made while this guest stood by in the pool as %s", spare_for)
            self._keys = spare
        else:
            if spare is not None:
                spare.cancel()
                log.info("not using the key made while standing by: this seed is not its hand-off")
            self._keys = make_keys(seed.instance_id)
        await asyncio.to_thread(identity.refresh_guest_identity, seed, ssh_keys=False)
        # SSH host keys take a while under emulation and do not gate the link: made in the
        # background once the link is up (or the agent waits anyway), not competing with the
        # enrollment's handshakes for the guest's CPU.
        self._ssh_keys_due = True
        if time.time() < seed.issued_at:  # the saved guest's clock lags: at least the seed's time
            identity.step_clock(seed.issued_at, tolerance=0.0)
        self._take_on(seed)
        return True

    def _stand_by(self, seed: identity.SeedIdentity) -> None:
        """A warm-pool member's seed (`seed_record`): no instance yet. Make the key of the
        instance this guest will become now, from a kernel generator reseeded with this
        member's own entropy (the restore left it as every member's), so the hand-off does
        not wait for it; and say on the console when it is made."""
        log.info("standing by in a warm pool as %s", seed.instance_id)
        for sess in list(self.sessions.values()):
            sess.shutdown()
        self.sessions.clear()
        self.outbox.clear()
        self.creds.forget()
        for task in (self._spare, self._warming):
            if task is not None:
                task.cancel()
        self._spare = self._warming = None
        self._spare_for = ""
        self.cfg.instance_id = seed.instance_id
        self.seeds.standing_by = True  # the hand-off's seed is looked for more often
        if seed.ca_pem and self.cfg.ca_cert is not None:
            self.cfg.ca_cert.write_text(seed.ca_pem)
            with contextlib.suppress(OSError):
                self.cfg.ca_path.unlink()
        if not self._reseed(seed):
            log.warning("%s without this member's own entropy: made at the hand-off", NO_SPARE_KEY)
            return
        self._spare = make_keys(seed.instance_id)
        self._spare_for = seed.instance_id
        self._warming = asyncio.ensure_future(self._warm_up(self._spare))

    async def _warm_up(self, spare: asyncio.Future[tuple[bytes, bytes]]) -> None:
        """A standing-by member's first connection, made now rather than at the hand-off: an
        enrollment channel through the guest's forward (its sync, the proxy's CONNECT, the TLS
        handshake), closed unused. In an emulated guest the first of each costs several times
        the next (gRPC's first channel, code QEMU has not translated yet). Then, with the spare
        key made, the console line the fleet pauses the member on."""
        started = time.monotonic()
        try:
            channel = await connect_channel(self.cfg, self.creds, "enroll", self.controls.current)
            try:
                async with asyncio.timeout(STANDBY_WARM_UP_SECONDS):
                    await channel.channel_ready()
            finally:
                await channel.close()
        except Exception as exc:  # only a warm-up: the hand-off makes its own connection
            log.info("standing by without a warm-up connection: %s", exc or type(exc).__name__)
        try:
            await asyncio.shield(spare)  # ending the warm-up (a hand-off) must not end the key
        except Exception as exc:  # the hand-off makes another
            log.warning("%s: %s", NO_SPARE_KEY, exc)
            return
        log.info("%s (%.0f ms)", SPARE_KEY_READY, (time.monotonic() - started) * 1000)

    @staticmethod
    def _reseed(seed: identity.SeedIdentity) -> bool:
        """Reseed the kernel's generator from the seed's entropy; whether it was."""
        if not seed.entropy:
            log.warning("the new seed carries no entropy: the kernel reseeds on its own later")
            return False
        try:
            entropy.reseed_kernel_rng(seed.entropy)
        except (OSError, ValueError) as exc:
            log.error("cannot reseed the kernel's random generator: %s", exc)
            return False
        log.info("kernel random generator reseeded from the seed")
        return True

    def _take_on(self, seed: identity.SeedIdentity) -> None:
        cfg = self.cfg
        cfg.instance_id = seed.instance_id
        for key in ("server", "enroll_server", "server_name", "gateway"):
            value = getattr(seed, key)
            if value:
                setattr(cfg, key, value)
        if seed.server and not seed.enroll_server:
            cfg.enroll_server = default_enroll(cfg.server)
        self.controls = Controls(cfg.control_addresses())
        if seed.ca_pem and cfg.ca_cert is not None:
            cfg.ca_cert.write_text(seed.ca_pem)
            with contextlib.suppress(OSError):
                cfg.ca_path.unlink()
        if cfg.enrollment_token_file is not None:
            pki.write_private(cfg.enrollment_token_file, seed.enrollment_token.encode())
        else:
            cfg.enrollment_token = seed.enrollment_token
        if cfg.config_path is not None:
            with contextlib.suppress(OSError):
                cfg.config_path.write_text(cfg.to_toml())
        self.run_id = uuid.uuid4().hex[:16]
        self._guard()  # the seed may name another gateway

    def _on_new_seed(self) -> None:
        self._seed_changed.set()
        if self.link is not None:
            self.link.cancel()

    def _refresh_ssh_keys_if_due(self) -> None:
        if self._ssh_keys_due:
            self._ssh_keys_due = False
            task = asyncio.ensure_future(asyncio.to_thread(identity.refresh_ssh_host_keys))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _guard(self) -> None:
        """Only root may open the guest's forward, or the bridge to its port (a guest's agent
        runs as root)."""
        ways = tuple(a for a in (self.cfg.gateway, self.cfg.bridge) if a)
        if not self.cfg.seed_identity or not ways or self._guarded == ways:
            return
        problem = guard_forward(*ways)
        if problem is not None:
            log.error("%s", problem)
        else:
            self._guarded = ways

    async def _open_serial_bridge(self) -> SerialBridge | None:
        """A guest whose machine has the link's virtio-serial port dials the gateway through
        it (`serial_link.py`); otherwise through the forward."""
        if not self.cfg.serial_port or not (self.cfg.gateway or self.cfg.seed_identity):
            return None
        bridge = await SerialBridge.open(self.cfg.serial_port)
        if bridge is not None:
            self.cfg.bridge = bridge.address
            log.info(
                "the link goes through the port %s (bridged at %s)",
                self.cfg.serial_port,
                bridge.address,
            )
        return bridge

    # ================================================================= the loop
    async def _pause(self, delay: float) -> None:
        """Back off for `delay` seconds, or until a new seed arrives (a warm-pool hand-off
        must not wait out a long backoff). A long pause makes the SSH host keys that are due
        (a short one does not: in a one-vCPU emulated guest they take seconds of CPU, which
        the retry that follows would wait for)."""
        if delay >= SSH_KEYS_IN_PAUSES_OF:
            self._refresh_ssh_keys_if_due()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await self._seed_changed.wait()
        self._seed_changed.clear()

    async def _enroll_until_done(self) -> None:
        backoff = Backoff(self.cfg.initial_backoff, self.cfg.max_backoff)
        while not self.creds.enrolled():
            at = self.controls.current.enroll
            if self._keys is not None and self._keys.done() and self._keys.exception():
                self._keys = None  # its failure was reported: the next try makes another
            try:
                await enroll(self.cfg, self.creds, self.controls.current, self._keys)
                self._keys = None
            except EnrollmentFailed as exc:
                if self.controls.failed(exc.leader):  # another control host, at once
                    log.warning("%s (at %s); trying %s", exc, at, self.controls.current.enroll)
                    continue
                delay = backoff.delay(None if exc.refused else UNREACHABLE_BACKOFF)
                log.error("%s; retrying in %.1fs", exc, delay)
                await self._pause(delay)
                if await self.adopt_seed_identity():
                    backoff.reset()

    async def _renew_if_due(self) -> None:
        """Renew between connections when the certificate is due (never beside a link)."""
        if time.time() < self.creds.renew_due():
            return
        try:
            await renew(self.cfg, self.creds, self.controls.current, None)
        except Exception as exc:
            log.warning("certificate renewal failed: %s", exc)

    def _on_link_up(self, link: Link) -> None:
        self.backoff.reset()
        self.controls.succeeded()
        self._refresh_ssh_keys_if_due()
        log.info(
            "connected to %s as instance %s in %.0f ms (channel %.0f; %d sessions)",
            self.cfg.route or link.control.link,
            self.cfg.instance_id,
            link.connect_seconds * 1000,
            link.channel_seconds * 1000,
            len(self.sessions),
        )

    async def run(self) -> None:
        self._main = asyncio.current_task()
        self.wake_event = asyncio.Event()
        self._seed_changed = asyncio.Event()
        adopted = self.keeper.adopted() if self.keeper is not None else []
        keep = frozenset(
            Path(d).name
            for a in adopted
            if isinstance(a.meta.get("cgroup"), dict)
            for d in a.meta["cgroup"]["dirs"].values()
        )
        # before any session starts: on cgroup v2 the agent moves into a leaf of its own cgroup
        self.cgroups = cgroups.detect(keep=keep, keeper=os.getppid() if self.keeper else 0)
        self.cgroups.refill()
        self._adopt(adopted)
        log.info(
            "run budgets: %s (%s)%s",
            self.cgroups.enforcement,
            ", ".join(self.cgroups.budgets),
            f"; {self.cgroups.problem}" if self.cgroups.problem else "",
        )
        bridge = await self._open_serial_bridge()
        self._guard()
        await self.adopt_seed_identity()
        egress = (
            await agent_egress.serve(self.cfg.egress_listen, self.streams, lambda: self.connected)
            if self.cfg.egress_listen
            else None
        )
        watcher = (
            asyncio.create_task(
                self.seeds.watch(
                    lambda s: s.instance_id == self.cfg.instance_id, self._on_new_seed
                ),
                name="agent-seed-watch",
            )
            if self.cfg.seed_identity
            else None
        )
        try:
            await self._enroll_until_done()
            while True:
                cap: float | None = UNREACHABLE_BACKOFF
                hint: tuple[str, str] | None = None
                await self._renew_if_due()
                link = self.link = Link(self, self.cfg, self.creds, self.controls.current)
                try:
                    await link.run(self._on_link_up)
                    log.warning("the server closed the link")
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if not self.seeds.changed.is_set() or (task is not None and task.cancelling()):
                        raise  # the agent is stopping
                except grpc.aio.AioRpcError as exc:
                    refused = exc.code() in REFUSED or protocol_refusal(exc) is not None
                    hint = leader_hint(exc.trailing_metadata())
                    if refused:
                        cap = None
                    log.log(
                        logging.ERROR if refused else logging.WARNING,
                        "link failed (%s): %s",
                        exc.code().name,
                        exc.details(),
                    )
                except (TimeoutError, ConnectionError, OSError) as exc:
                    log.warning("link failed: %s", exc or type(exc).__name__)
                finally:
                    self.link = None
                    self.streams.link_lost()
                changed = self.seeds.changed.is_set()
                self.seeds.changed.clear()
                # A restored guest (a clone, a hand-off) learns it from the link that broke:
                # its seed says at once who it is now, with no backoff first; and it never
                # reconnects under an identity its seed no longer names.
                if await self.adopt_seed_identity():
                    await self._enroll_until_done()
                    continue
                if changed:
                    continue  # dropped for a new seed that named this instance after all
                if not self.cfg.route and self.controls.failed(hint):
                    log.info("trying control host %s", self.controls.current.link)
                else:
                    delay = self.backoff.delay(cap)
                    log.info("reconnecting in %.2fs", delay)
                    await self._pause(delay)
                if await self.adopt_seed_identity():  # a new seed during the backoff
                    await self._enroll_until_done()
        finally:
            if watcher is not None:
                watcher.cancel()
            if egress is not None:
                egress.close()
            if bridge is not None:
                await bridge.aclose()
                self.cfg.bridge = ""
            self.streams.link_lost()
            if self.handing_over:
                log.info("handing %d sessions to the keeper", len(self.sessions))
                for sess in self.sessions.values():
                    sess.hand_over()
                self.cgroups.drop_spares()  # named for this worker: the next makes its own
            else:
                for sess in self.sessions.values():
                    sess.shutdown()
                self.cgroups.release()
