"""The agent's life: enroll once, hold one link to the server, run sessions, renew in time.

The link is one `Connect` stream over mutual TLS. On every (re)connection the agent registers
with its session inventory; the server answers where each session's output resumes (the agent
resends from there) and which sessions to end. Reconnects use jittered exponential backoff
(`initial_backoff` .. `max_backoff`, default 0.5 s .. 30 s). Sessions keep running while the
link is down; their output waits in their rings (and the PTYs block once a ring is full of
unacknowledged output).

Output batching: a session that produced a small read (an echo) is sent at once; one that is
flooding is sent in messages of up to 64 KiB, waiting at most 2 ms to fill one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import socket
import time
import uuid
from collections import deque
from importlib import metadata
from typing import Any

import grpc

from agentic_sandbox.agent import identity, pki
from agentic_sandbox.agent.config import AgentConfig
from agentic_sandbox.agent.session import PtySession, SpawnError
from agentic_sandbox.agent.sysinfo import SysInfo
from agentic_sandbox.proto import agent_pb2 as pb
from agentic_sandbox.proto import agent_pb2_grpc as pb_grpc

log = logging.getLogger("agent")

BATCH_BYTES = 64 * 1024
BATCH_WAIT = 0.002
CONNECT_TIMEOUT = 15.0
DEFAULT_HEARTBEAT = 5.0
SIGNAL_NAMES = {
    pb.SIGNAL_INT: "INT",
    pb.SIGNAL_TERM: "TERM",
    pb.SIGNAL_KILL: "KILL",
    pb.SIGNAL_HUP: "HUP",
}
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 4 * 1024 * 1024),
    ("grpc.enable_retries", 0),
]


def agent_version() -> str:
    try:
        return metadata.version("agentic-sandbox")
    except metadata.PackageNotFoundError:
        return "0.1.0"


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class Backoff:
    """Jittered exponential backoff: each delay is uniform in [d/2, d], d doubling to max."""

    def __init__(self, initial: float, maximum: float) -> None:
        self.initial = initial
        self.maximum = maximum
        self._next = initial

    def reset(self) -> None:
        self._next = self.initial

    def delay(self) -> float:
        d = self._next
        self._next = min(self.maximum, d * 2)
        return random.uniform(d / 2, d)


SEED_POLL_SECONDS = 0.25


class IdentityChanged(Exception):
    """The guest was given another instance's identity (a new seed): reconnect as it."""


class EnrollmentFailed(Exception):
    pass


class AgentRuntime:
    def __init__(self, config: AgentConfig) -> None:
        self.cfg = config
        self.sessions: dict[str, PtySession] = {}
        self.outbox: deque[pb.AgentMessage] = deque()
        self.run_id = uuid.uuid4().hex[:16]
        self.connected = False
        self.heartbeat_interval = DEFAULT_HEARTBEAT
        self.sysinfo = SysInfo()
        self.backoff = Backoff(config.initial_backoff, config.max_backoff)
        self._wake: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None
        self._batch_timer: asyncio.TimerHandle | None = None
        self._live_channel: grpc.aio.Channel | None = None  # the mTLS link while connected
        self._call: Any = None
        self._connecting: asyncio.Future[None] | None = None
        self._seed_fp: bytes | None = None
        self._seed_changed = asyncio.Event()
        self._background: set[asyncio.Future[None]] = set()
        self._ssh_keys_due = False  # new SSH host keys owed to a taken-on identity
        self._fresh_seed: tuple[bytes | None, identity.SeedIdentity] | None = None
        self.identity_changed = False

    # ================================================================= credentials
    def _read(self, path: os.PathLike[str] | str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def _ca(self) -> bytes:
        if self.cfg.ca_path.exists():
            return self._read(self.cfg.ca_path)
        if self.cfg.ca_cert is None:
            raise EnrollmentFailed("no CA certificate: set ca_cert (the server's agent-link CA)")
        return self._read(self.cfg.ca_cert)

    def _cert_meta(self) -> dict[str, Any]:
        try:
            meta: dict[str, Any] = json.loads(self.cfg.cert_meta_path.read_text())
        except (OSError, ValueError):
            return {}
        return meta

    def enrolled(self) -> bool:
        meta = self._cert_meta()
        return (
            self.cfg.key_path.exists()
            and self.cfg.cert_path.exists()
            and meta.get("instance_id") == self.cfg.instance_id
            and float(meta.get("not_after", 0)) > time.time() + 5
        )

    def _store(self, key_pem: bytes, cert_pem: bytes, ca_pem: bytes, not_after: int) -> None:
        self.cfg.state_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(PermissionError):
            os.chmod(self.cfg.state_dir, 0o700)
        pki.write_private(self.cfg.key_path, key_pem)
        pki.write_private(self.cfg.cert_path, cert_pem)
        if ca_pem:
            pki.write_private(self.cfg.ca_path, ca_pem)
        meta = {
            "instance_id": self.cfg.instance_id,
            "issued_at": time.time(),
            "not_after": not_after,
        }
        pki.write_private(self.cfg.cert_meta_path, json.dumps(meta).encode())

    def _server_creds(self, with_client_cert: bool) -> grpc.ChannelCredentials:
        if with_client_cert:
            return grpc.ssl_channel_credentials(
                root_certificates=self._ca(),
                private_key=self._read(self.cfg.key_path),
                certificate_chain=self._read(self.cfg.cert_path),
            )
        return grpc.ssl_channel_credentials(root_certificates=self._ca())

    def _channel(self, target: str, with_client_cert: bool) -> grpc.aio.Channel:
        options = [*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", self.cfg.server_name)]
        return grpc.aio.secure_channel(
            target, self._server_creds(with_client_cert), options=options
        )

    async def enroll(self) -> None:
        token = self.cfg.token()
        if not token:
            raise EnrollmentFailed(
                "not enrolled and no enrollment token (set enrollment_token_file)"
            )
        try:
            key, csr = await asyncio.to_thread(pki.new_key_and_csr, self.cfg.instance_id)
        except pki.PkiError as exc:
            raise EnrollmentFailed(str(exc)) from None
        channel = self._channel(self.cfg.enroll_server, with_client_cert=False)
        try:
            stub = pb_grpc.AgentLinkStub(channel)
            resp = await stub.Enroll(
                pb.EnrollRequest(instance_id=self.cfg.instance_id, token=token, csr_pem=csr),
                timeout=CONNECT_TIMEOUT,
            )
        except grpc.aio.AioRpcError as exc:
            raise EnrollmentFailed(
                f"enrollment refused ({exc.code().name}): {exc.details()}"
            ) from None
        finally:
            await channel.close()
        self._store(key, resp.certificate_pem, resp.ca_pem, resp.not_after_unix)
        log.info(
            "enrolled as instance %s; certificate valid until %s",
            self.cfg.instance_id,
            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(resp.not_after_unix)),
        )

    async def renew(self) -> None:
        key, csr = await asyncio.to_thread(pki.new_key_and_csr, self.cfg.instance_id)
        # Over the live link when there is one: an isolated guest reaches the link port through
        # a single forwarded connection.
        live = self._live_channel
        channel = live or self._channel(self.cfg.server, with_client_cert=True)
        try:
            resp = await pb_grpc.AgentLinkStub(channel).Renew(
                pb.RenewRequest(csr_pem=csr), timeout=CONNECT_TIMEOUT
            )
        finally:
            if channel is not live:
                await channel.close()
        self._store(key, resp.certificate_pem, resp.ca_pem, resp.not_after_unix)
        log.info(
            "certificate renewed; valid until %s",
            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(resp.not_after_unix)),
        )

    async def _renewal_loop(self) -> None:
        """Renew when a third of the certificate's lifetime is left."""
        while True:
            meta = self._cert_meta()
            issued = float(meta.get("issued_at", time.time()))
            not_after = float(meta.get("not_after", 0))
            lifetime = max(1.0, not_after - issued)
            renew_at = not_after - lifetime / 3
            now = time.time()
            if now >= renew_at:
                try:
                    await self.renew()
                    continue
                except Exception as exc:
                    log.warning("certificate renewal failed: %s", exc)
                    await asyncio.sleep(min(60.0, max(1.0, lifetime / 20)))
                    continue
            await asyncio.sleep(min(60.0, max(0.5, renew_at - now)))

    # ================================================================= sessions
    def wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _session_done(self) -> None:
        self.wake()

    def _open(self, msg: pb.OpenSession) -> pb.AgentMessage:
        sid = msg.session_id
        if sid in self.sessions:
            existing = self.sessions[sid]
            return pb.AgentMessage(
                opened=pb.SessionOpened(session_id=sid, ok=True, pid=existing.pid)
            )
        if len([s for s in self.sessions.values() if not s.finished]) >= self.cfg.max_sessions:
            return pb.AgentMessage(
                opened=pb.SessionOpened(
                    session_id=sid,
                    ok=False,
                    error=f"this agent runs at most {self.cfg.max_sessions} sessions",
                )
            )
        try:
            sess = PtySession.spawn(
                sid,
                command=list(msg.command),
                cols=msg.cols or 80,
                rows=msg.rows or 24,
                env=dict(msg.env),
                cwd=msg.cwd,
                user=msg.user or self.cfg.default_user,
                ring_bytes=self.cfg.ring_bytes,
                task_id=msg.task_id,
                on_output=self.wake,
                on_finish=self._session_done,
            )
        except SpawnError as exc:
            log.warning("session %s could not start: %s", sid, exc)
            return pb.AgentMessage(
                opened=pb.SessionOpened(session_id=sid, ok=False, error=str(exc))
            )
        self.sessions[sid] = sess
        log.info(
            "session %s started (pid %d)", sid, sess.pid, extra={"session_id": sid, "pid": sess.pid}
        )
        return pb.AgentMessage(opened=pb.SessionOpened(session_id=sid, ok=True, pid=sess.pid))

    def _inventory(self) -> list[pb.SessionInventory]:
        out = []
        for s in self.sessions.values():
            exit_info = None
            if s.finished and s.exit is not None:
                exit_info = pb.ExitInfo(
                    has_code=s.exit.code is not None,
                    code=s.exit.code or 0,
                    signal=s.exit.signal,
                    error=s.exit.error,
                )
            out.append(
                pb.SessionInventory(
                    session_id=s.id,
                    state=pb.SESSION_STATE_EXITED if s.finished else pb.SESSION_STATE_RUNNING,
                    ring_start=s.ring.start,
                    end_offset=s.ring.end,
                    exit=exit_info,
                    cols=s.cols,
                    rows=s.rows,
                    pid=s.pid,
                    task_id=s.task_id,
                )
            )
        return out

    def _forget(self, sid: str) -> None:
        sess = self.sessions.pop(sid, None)
        if sess is not None:
            sess.shutdown()

    def _handle(self, msg: pb.ServerMessage) -> None:
        kind = msg.WhichOneof("body")
        if kind == "input":
            sess = self.sessions.get(msg.input.session_id)
            if sess is not None:
                sess.write_input(msg.input.data)
        elif kind == "ack":
            sess = self.sessions.get(msg.ack.session_id)
            if sess is not None and msg.ack.offset > sess.acked:
                sess.acked = min(msg.ack.offset, sess.ring.end)
                sess.update_flow()
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
            if self.cfg.seed_identity:  # a guest: follow the server's clock
                identity.step_clock(msg.heartbeat_ack.server_time_unix_ms / 1000.0)
        elif kind == "close":
            sess = self.sessions.get(msg.close.session_id)
            if sess is not None:
                if sess.finished:
                    self._forget(sess.id)
                else:
                    sess.close(msg.close.grace_ms / 1000.0)
        else:
            log.warning("unexpected message from the server: %s", kind)

    def _apply_ack(self, ack: pb.RegisterAck) -> None:
        if ack.heartbeat_interval_ms:
            self.heartbeat_interval = max(0.05, ack.heartbeat_interval_ms / 1000.0)
        resumed = set()
        for r in ack.resume:
            sess = self.sessions.get(r.session_id)
            if sess is None:
                continue
            frm = max(sess.ring.start, min(r.from_offset, sess.ring.end))
            if frm != r.from_offset:
                log.warning(
                    "session %s: server asked for output from %d, resending from %d",
                    sess.id,
                    r.from_offset,
                    frm,
                )
            sess.sent = frm
            sess.acked = max(sess.acked, frm)
            sess.exit_sent = False
            sess.first_pending = None
            sess.update_flow()
            resumed.add(sess.id)
        for sid in ack.close:
            sess = self.sessions.get(sid)
            if sess is None:
                continue
            if sess.finished:
                self._forget(sid)
            else:
                sess.close(2.0)
        for sid, sess in list(self.sessions.items()):
            if sid not in resumed and sid not in ack.close:
                # The server did not mention it: send everything we still hold.
                sess.sent = sess.ring.start
                sess.exit_sent = False

    # ================================================================= the link
    def _next_message(self, now: float) -> tuple[pb.AgentMessage | None, float | None]:
        """The next message to send, or (None, seconds to wait for a batch to fill)."""
        if self.outbox:
            return self.outbox.popleft(), None
        wait: float | None = None
        for sess in list(self.sessions.values()):
            pending = sess.pending
            if pending > 0:
                if (
                    pending < BATCH_BYTES
                    and sess.flooding
                    and not sess.finished
                    and sess.first_pending is not None
                ):
                    left = sess.first_pending + BATCH_WAIT - now
                    if left > 0:
                        wait = left if wait is None else min(wait, left)
                        continue
                data = sess.ring.read(sess.sent, BATCH_BYTES)
                msg = pb.AgentMessage(
                    output=pb.SessionOutput(session_id=sess.id, offset=sess.sent, data=data)
                )
                sess.sent += len(data)
                sess.first_pending = now if sess.pending else None
                sess.update_flow()
                return msg, None
            if sess.finished and not sess.exit_sent and sess.exit is not None:
                sess.exit_sent = True
                return pb.AgentMessage(
                    exit=pb.SessionExit(
                        session_id=sess.id,
                        end_offset=sess.ring.end,
                        exit=pb.ExitInfo(
                            has_code=sess.exit.code is not None,
                            code=sess.exit.code or 0,
                            signal=sess.exit.signal,
                            error=sess.exit.error,
                        ),
                    )
                ), None
        return None, wait

    async def _sender(self, call: Any) -> None:
        loop = asyncio.get_running_loop()
        wake = self._wake
        assert wake is not None
        while True:
            wake.clear()
            msg, wait = self._next_message(loop.time())
            if msg is not None:
                await call.write(msg)
                continue
            if wait is not None:
                timer = loop.call_later(wait, wake.set)
                try:
                    await wake.wait()
                finally:
                    timer.cancel()
            else:
                await wake.wait()

    async def _heartbeats(self) -> None:
        while True:
            s = self.sysinfo.sample()
            # At most one heartbeat waits in the outbox: a slow link gets the newest one.
            for queued in [m for m in self.outbox if m.WhichOneof("body") == "heartbeat"]:
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
                    )
                )
            )
            self.wake()
            await asyncio.sleep(self.heartbeat_interval)

    def silence_limit(self) -> float:
        """A link that says nothing for this long is dead (the server acks every heartbeat)."""
        return max(3 * self.heartbeat_interval, 5.0)

    async def _connect_once(self) -> None:
        channel = self._channel(self.cfg.server, with_client_cert=True)
        tasks: list[asyncio.Task[None]] = []
        try:
            call = pb_grpc.AgentLinkStub(channel).Connect()
            self._call = call
            register = pb.Register(
                instance_id=self.cfg.instance_id,
                agent_version=agent_version(),
                hostname=socket.gethostname(),
                boot_id=_boot_id(),
                agent_run_id=self.run_id,
                ring_bytes=self.cfg.ring_bytes,
                sessions=self._inventory(),
            )
            await asyncio.wait_for(call.write(pb.AgentMessage(register=register)), CONNECT_TIMEOUT)
            first = await asyncio.wait_for(call.read(), CONNECT_TIMEOUT)
            if first is grpc.aio.EOF or first.WhichOneof("body") != "register_ack":
                raise ConnectionError("the server did not acknowledge the registration")
            self.outbox.clear()
            self._apply_ack(first.register_ack)
            self.connected = True
            self._live_channel = channel
            self.backoff.reset()
            self._refresh_ssh_keys_if_due()
            log.info(
                "connected to %s as instance %s (%d sessions)",
                self.cfg.server,
                self.cfg.instance_id,
                len(self.sessions),
            )
            tasks = [
                asyncio.create_task(self._sender(call), name="agent-sender"),
                asyncio.create_task(self._heartbeats(), name="agent-heartbeats"),
            ]
            while True:
                try:
                    msg = await asyncio.wait_for(call.read(), self.silence_limit())
                except TimeoutError:
                    raise ConnectionError(
                        f"the link was silent for {self.silence_limit():.0f}s"
                    ) from None
                except asyncio.CancelledError:
                    if self.identity_changed:
                        raise IdentityChanged() from None
                    raise
                if msg is grpc.aio.EOF:
                    break
                self._handle(msg)
                for t in tasks:
                    if t.done():
                        t.result()  # surface a failed sender
        finally:
            self.connected = False
            self._live_channel = None
            self._call = None
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            await channel.close()

    # ================================================================= identity (guests)
    async def adopt_seed_identity(self) -> bool:
        """Take on the identity written on the cloud-init seed if it is not ours (a clone or a
        warm-pool hand-off). Returns whether the identity changed."""
        if not self.cfg.seed_identity:
            return False
        identity.unlock_cdrom_trays()
        if self._fresh_seed is not None:  # just read by the seed watcher: not again
            (fp, seed), self._fresh_seed = self._fresh_seed, None
        else:
            fp = await asyncio.to_thread(identity.seed_fingerprint)
            found = await asyncio.to_thread(identity.read_seed)
            if found is None:
                return False
            seed = found
        self._seed_fp = fp
        if seed.instance_id == self.cfg.instance_id:
            return False
        log.warning(
            "this guest was restored as instance %s (was %s): taking on its identity",
            seed.instance_id,
            self.cfg.instance_id,
        )
        for sess in list(self.sessions.values()):  # the other instance's sessions
            sess.shutdown()
        self.sessions.clear()
        self.outbox.clear()
        for path in (self.cfg.key_path, self.cfg.cert_path, self.cfg.cert_meta_path):
            with contextlib.suppress(OSError):
                path.unlink()
        await asyncio.to_thread(identity.refresh_guest_identity, seed, ssh_keys=False)
        # SSH host keys take a while under emulation and do not gate the link: made in the
        # background once the link is up (or the agent waits anyway), not competing with the
        # enrollment's handshakes for the guest's CPU.
        self._ssh_keys_due = True
        if time.time() < seed.issued_at:  # the saved guest's clock lags: at least the seed's time
            identity.step_clock(seed.issued_at, tolerance=0.0)
        self.cfg.instance_id = seed.instance_id
        if seed.server:
            self.cfg.server = seed.server
        if seed.enroll_server:
            self.cfg.enroll_server = seed.enroll_server
        if seed.server_name:
            self.cfg.server_name = seed.server_name
        if seed.ca_pem and self.cfg.ca_cert is not None:
            self.cfg.ca_cert.write_text(seed.ca_pem)
            with contextlib.suppress(OSError):
                self.cfg.ca_path.unlink()
        if self.cfg.enrollment_token_file is not None:
            pki.write_private(self.cfg.enrollment_token_file, seed.enrollment_token.encode())
        else:
            self.cfg.enrollment_token = seed.enrollment_token
        if self.cfg.config_path is not None:
            with contextlib.suppress(OSError):
                self.cfg.config_path.write_text(self.cfg.to_toml())
        self.run_id = uuid.uuid4().hex[:16]
        self.identity_changed = False
        return True

    async def _watch_seed(self) -> None:
        """Notice within a quarter second that the guest was given a new seed (restored as a
        clone, or handed out from the warm pool). A 64 KiB O_DIRECT read each time: cheap."""
        while True:
            await asyncio.sleep(SEED_POLL_SECONDS)
            fp = await asyncio.to_thread(identity.seed_fingerprint)
            if fp is None or fp == self._seed_fp:
                continue
            seed = await asyncio.to_thread(identity.read_seed)
            if seed is None:
                # The new medium is not readable yet (the guest is still taking the media
                # change in): look again on the next tick rather than forget the change.
                continue
            self._seed_fp = fp
            if seed.instance_id != self.cfg.instance_id:
                log.warning("a new seed names instance %s: dropping the link", seed.instance_id)
                self._fresh_seed = (fp, seed)
                self.identity_changed = True
                self._seed_changed.set()
                if self._call is not None:
                    self._call.cancel()
                elif self._connecting is not None:
                    self._connecting.cancel()

    def _refresh_ssh_keys_if_due(self) -> None:
        if self._ssh_keys_due:
            self._ssh_keys_due = False
            task = asyncio.ensure_future(asyncio.to_thread(identity.refresh_ssh_host_keys))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _pause(self, delay: float) -> None:
        """Back off for `delay` seconds, or until a new seed arrives (a warm-pool hand-off
        must not wait out a long backoff)."""
        self._refresh_ssh_keys_if_due()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._seed_changed.wait(), delay)
        self._seed_changed.clear()

    async def _enroll_until_done(self) -> None:
        enroll_backoff = Backoff(self.cfg.initial_backoff, self.cfg.max_backoff)
        while not self.enrolled():
            try:
                await self.enroll()
            except EnrollmentFailed as exc:
                delay = enroll_backoff.delay()
                log.error("%s; retrying in %.1fs", exc, delay)
                await self._pause(delay)
                if await self.adopt_seed_identity():
                    enroll_backoff.reset()

    async def run(self) -> None:
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._seed_changed = asyncio.Event()
        await self.adopt_seed_identity()
        watcher = (
            asyncio.create_task(self._watch_seed(), name="agent-seed-watch")
            if self.cfg.seed_identity
            else None
        )
        renewal: asyncio.Task[None] | None = None
        try:
            await self._enroll_until_done()
            renewal = asyncio.create_task(self._renewal_loop(), name="agent-renewal")
            while True:
                try:
                    self._connecting = asyncio.ensure_future(self._connect_once())
                    try:
                        await self._connecting
                    finally:
                        self._connecting = None
                    log.warning("the server closed the link")
                except (IdentityChanged, asyncio.CancelledError) as exc:
                    if not self.identity_changed and isinstance(exc, asyncio.CancelledError):
                        raise
                    if await self.adopt_seed_identity():
                        await self._enroll_until_done()
                    continue
                except grpc.aio.AioRpcError as exc:
                    level = (
                        logging.ERROR
                        if exc.code()
                        in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)
                        else logging.WARNING
                    )
                    log.log(level, "link failed (%s): %s", exc.code().name, exc.details())
                except (TimeoutError, ConnectionError, OSError) as exc:
                    log.warning("link failed: %s", exc or type(exc).__name__)
                delay = self.backoff.delay()
                log.info("reconnecting in %.2fs", delay)
                await self._pause(delay)
                if await self.adopt_seed_identity():
                    await self._enroll_until_done()
        finally:
            if renewal is not None:
                renewal.cancel()
            if watcher is not None:
                watcher.cancel()
            for sess in self.sessions.values():
                sess.shutdown()
