"""agent-client configuration, backoff and output batching decisions."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentic_sandbox.agent.config import ConfigError, load, parser
from agentic_sandbox.agent.runtime import BATCH_BYTES, AgentRuntime, Backoff


def test_file_then_flags(tmp_path: Path) -> None:
    cfg_file = tmp_path / "agent.toml"
    cfg_file.write_text(
        'instance_id = "web-1"\nserver = "10.0.2.2:9000"\nca_cert = "/etc/ca.crt"\n'
        "initial_backoff = 0.25\n"
    )
    cfg = load(parser().parse_args(["--config", str(cfg_file), "--max-backoff", "5"]))
    assert cfg.instance_id == "web-1" and cfg.server == "10.0.2.2:9000"
    assert cfg.enroll_server == "10.0.2.2:8121"
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


class _FakeRing:
    def __init__(self, data: bytes) -> None:
        self.start, self.end, self.data = 0, len(data), data

    def read(self, offset: int, n: int) -> bytes:
        return self.data[offset : offset + n]


class _FakeSession:
    def __init__(self, data: bytes, flooding: bool, first_pending: float) -> None:
        self.id = "s"
        self.ring = _FakeRing(data)
        self.sent = 0
        self.flooding = flooding
        self.finished = False
        self.exit = None
        self.exit_sent = False
        self.first_pending: float | None = first_pending

    @property
    def pending(self) -> int:
        return self.ring.end - self.sent

    def update_flow(self) -> None:
        pass


def test_echo_goes_at_once_and_a_flood_is_batched(tmp_path: Path) -> None:
    rt = AgentRuntime(load(parser().parse_args(["--instance-id", "x"])))
    echo = _FakeSession(b"a", flooding=False, first_pending=100.0)
    rt.sessions = {"s": echo}  # type: ignore[dict-item]
    msg, wait = rt._next_message(100.0)
    assert msg is not None and msg.output.data == b"a" and wait is None

    flood = _FakeSession(b"y" * 10_000, flooding=True, first_pending=100.0)
    rt.sessions = {"s": flood}  # type: ignore[dict-item]
    msg, wait = rt._next_message(100.0005)  # under 64 KiB and under 2 ms old: wait
    assert msg is None and wait is not None and 0 < wait <= 0.002
    msg, wait = rt._next_message(100.003)  # 2 ms passed: send what there is
    assert msg is not None and len(msg.output.data) == 10_000

    big = _FakeSession(b"z" * (3 * BATCH_BYTES), flooding=True, first_pending=100.0)
    rt.sessions = {"s": big}  # type: ignore[dict-item]
    sizes = []
    while True:
        msg, _ = rt._next_message(100.0)
        if msg is None:
            break
        sizes.append(len(msg.output.data))
        assert msg.output.offset == sum(sizes[:-1])
    assert sizes == [BATCH_BYTES] * 3
