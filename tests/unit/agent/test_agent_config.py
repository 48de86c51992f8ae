"""agent-client configuration, backoff and output batching decisions."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentic_sandbox.agent.channels import target_and_options
from agentic_sandbox.agent.config import ConfigError, load, parser
from agentic_sandbox.agent.runtime import AgentRuntime, Backoff
from agentic_sandbox.agent.session import BATCH_BYTES, PtySession


def test_file_then_flags(tmp_path: Path) -> None:
    cfg_file = tmp_path / "agent.toml"
    cfg_file.write_text(
        'instance_id = "web-1"\nserver = "10.0.2.2:9000"\nca_cert = "/etc/ca.crt"\n'
        "initial_backoff = 0.25\n"
    )
    cfg = load(parser().parse_args(["--config", str(cfg_file), "--max-backoff", "5"]))
    assert cfg.instance_id == "web-1" and cfg.server == "10.0.2.2:9000"
    assert cfg.enroll_server == "10.0.2.2:8121" and cfg.gateway == ""
    assert cfg.ca_cert == Path("/etc/ca.crt")
    assert (cfg.initial_backoff, cfg.max_backoff) == (0.25, 5.0)


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--instance-id", "Bad_Id"],
        ["--instance-id", "ok", "--server", "nohost"],
        ["--instance-id", "ok", "--initial-backoff", "60", "--max-backoff", "1"],
        ["--instance-id", "ok", "--ring-bytes", "100"],
    ],
)
def test_bad_configuration_is_named(args: list[str]) -> None:
    with pytest.raises(ConfigError):
        load(parser().parse_args(args))


def test_unknown_file_keys_are_refused(tmp_path: Path) -> None:
    cfg_file = tmp_path / "agent.toml"
    cfg_file.write_text('instance_id = "x"\ncolour = "blue"\n')
    with pytest.raises(ConfigError, match="colour"):
        load(parser().parse_args(["--config", str(cfg_file)]))


def test_backoff_is_jittered_exponential_and_capped() -> None:
    b = Backoff(0.5, 30.0)
    delays = [b.delay() for _ in range(12)]
    assert 0.25 <= delays[0] <= 0.5
    assert 0.5 <= delays[1] <= 1.0
    assert all(d <= 30.0 for d in delays) and delays[-1] >= 15.0
    b.reset()
    assert b.delay() <= 0.5


def test_backoff_cap_for_an_unreachable_server() -> None:
    b = Backoff(0.5, 30.0)
    for _ in range(10):
        assert b.delay(cap=1.0) <= 1.0  # the server does not answer: keep trying each second
    assert b.delay() > 1.0  # a refusal backs off fully (the sequence kept growing)


def test_a_guest_agent_dials_the_gateway_by_name_and_never_an_environment_proxy() -> None:
    guest = load(parser().parse_args(["--instance-id", "g", "--gateway", "10.0.2.2:8124"]))
    target, options = target_and_options(guest, "link", guest.control_addresses()[0])
    assert target == "link.agentic-sandbox.invalid:443"
    assert ("grpc.http_proxy", "http://10.0.2.2:8124") in options
    assert (
        target_and_options(guest, "enroll", guest.control_addresses()[0])[0]
        == "enroll.agentic-sandbox.invalid:443"
    )
    host = load(parser().parse_args(["--instance-id", "h", "--server", "127.0.0.1:9000"]))
    target, options = target_and_options(host, "link", host.control_addresses()[0])
    assert target == "127.0.0.1:9000" and ("grpc.enable_http_proxy", 0) in options
    with pytest.raises(ConfigError, match="gateway"):
        load(parser().parse_args(["--instance-id", "g", "--gateway", "nohost"]))


def _session(data: bytes, *, flooding: bool, first_pending: float) -> PtySession:
    """A real session (a real PTY running `cat`) whose ring holds `data`, unsent."""
    sess = PtySession.spawn(
        "s",
        command=["cat"],
        cols=80,
        rows=24,
        env={},
        cwd="",
        user="",
        ring_bytes=1024 * 1024,
        task_id="",
        on_output=lambda: None,
        on_finish=lambda: None,
    )
    sess.ring.append(data)
    sess.flooding = flooding
    sess.first_pending = first_pending
    return sess


async def test_echo_goes_at_once_and_a_flood_is_batched() -> None:
    echo = _session(b"a", flooding=False, first_pending=100.0)
    flood = _session(b"y" * 10_000, flooding=True, first_pending=100.0)
    big = _session(b"z" * (3 * BATCH_BYTES), flooding=True, first_pending=100.0)
    try:
        msg, wait = echo.next_message(100.0)
        assert msg is not None and msg.output.data == b"a" and wait is None

        msg, wait = flood.next_message(100.0005)  # under 64 KiB and under 2 ms old: wait
        assert msg is None and wait is not None and 0 < wait <= 0.002
        msg, wait = flood.next_message(100.003)  # 2 ms passed: send what there is
        assert msg is not None and len(msg.output.data) == 10_000

        sizes = []
        while True:
            msg, _ = big.next_message(100.0)
            if msg is None:
                break
            sizes.append(len(msg.output.data))
            assert msg.output.offset == sum(sizes[:-1])
        assert sizes == [BATCH_BYTES] * 3
        rt = AgentRuntime(load(parser().parse_args(["--instance-id", "x"])))
        rt.sessions = {"e": _session(b"hi", flooding=False, first_pending=1.0)}
        msg, _ = rt.next_message(1.0)
        assert msg is not None and msg.output.data == b"hi"
        rt.sessions["e"].shutdown()
    finally:
        for s in (echo, flood, big):
            s.shutdown()


async def test_a_session_resumes_where_the_server_asks_within_its_ring() -> None:
    sess = _session(b"0123456789", flooding=False, first_pending=1.0)
    try:
        assert sess.resume_from(4) == 4 and sess.sent == 4
        msg, _ = sess.next_message(1.0)
        assert msg is not None and msg.output.offset == 4 and msg.output.data == b"456789"
        assert sess.resume_from(99) == 10  # beyond the end: from the end
        sess.ack(7)
        assert sess.acked == 10  # the resume raised acked; an older ack does not lower it
        sess.resend_all()
        assert sess.sent == 0
    finally:
        sess.shutdown()


def test_a_guest_agent_with_its_port_bridged_dials_the_bridge(tmp_path: Path) -> None:
    """The bridge to the link's virtio-serial port replaces the forward as the agent's gateway;
    it is set while the agent runs, never read from the file nor written to it, and an
    operator's `serial_port = ""` (the forward only) survives the agent rewriting its file."""
    cfg_file = tmp_path / "agent.toml"
    cfg_file.write_text('instance_id = "g"\ngateway = "10.0.2.2:8124"\nserial_port = ""\n')
    guest = load(parser().parse_args(["--config", str(cfg_file)]))
    assert guest.serial_port == "" and guest.route == "10.0.2.2:8124"
    guest.bridge = "127.0.0.1:40123"
    _target, options = target_and_options(guest, "link", guest.control_addresses()[0])
    assert ("grpc.http_proxy", "http://127.0.0.1:40123") in options
    written = guest.to_toml()
    assert 'serial_port = ""' in written and "bridge" not in written and "40123" not in written
    cfg_file.write_text(written)
    assert load(parser().parse_args(["--config", str(cfg_file)])).serial_port == ""
    cfg_file.write_text('instance_id = "g"\nbridge = "127.0.0.1:1"\n')
    with pytest.raises(ConfigError, match="bridge"):
        load(parser().parse_args(["--config", str(cfg_file)]))
    with pytest.raises(ConfigError, match="serial_port"):
        load(parser().parse_args(["--instance-id", "g", "--config", str(_toml(tmp_path))]))


def _toml(tmp_path: Path) -> Path:
    f = tmp_path / "relative.toml"
    f.write_text('instance_id = "g"\nserial_port = "dev/vport0p1"\n')
    return f
