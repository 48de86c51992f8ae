"""Several control hosts from the agent's side: its address list, and which one it dials next."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentic_sandbox.agent.channels import target_and_options
from agentic_sandbox.agent.config import ConfigError, load, parser
from agentic_sandbox.agent.controls import ControlAddress, Controls, leader_hint
from agentic_sandbox.proto import LEADER_METADATA

A, B, C = (ControlAddress(f"10.9.0.{i}:8120", f"10.9.0.{i}:8121") for i in (1, 2, 3))


def test_a_comma_list_or_a_toml_list_gives_every_control_host(tmp_path: Path) -> None:
    cfg = load(parser().parse_args(["--instance-id", "h", "--server", "a:1, b:2"]))
    assert cfg.control_addresses() == [
        ControlAddress("a:1", "a:8121"),
        ControlAddress("b:2", "b:8121"),
    ]
    f = tmp_path / "agent.toml"
    f.write_text('instance_id = "h"\nserver = ["a:1", "b:2"]\nenroll_server = ["a:7", "b:8"]\n')
    cfg = load(parser().parse_args(["--config", str(f)]))
    assert cfg.control_addresses() == [ControlAddress("a:1", "a:7"), ControlAddress("b:2", "b:8")]
    # the file written back after an identity change reads the same
    f.write_text(cfg.to_toml())
    assert load(parser().parse_args(["--config", str(f)])).control_addresses() == (
        cfg.control_addresses()
    )
    target, _ = target_and_options(cfg, "enroll", cfg.control_addresses()[1])
    assert target == "b:8"


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--server", "a:1,nohost"], "'nohost'"),
        (["--server", ","], "server"),
        (["--server", "a:1,b:2", "--enroll-server", "a:7"], "one address per server"),
    ],
)
def test_a_bad_address_list_is_named(args: list[str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        load(parser().parse_args(["--instance-id", "h", *args]))


def test_a_failed_address_moves_on_at_once_until_every_one_failed() -> None:
    c = Controls([A, B, C])
    assert c.current == A
    assert c.failed() is True and c.current == B
    assert c.failed() is True and c.current == C
    assert c.failed() is False and c.current == A  # a whole round failed: back off, then A
    assert c.failed() is True and c.current == B
    c.succeeded()  # B holds the link: the next failure starts a new round
    assert c.failed() is True and c.failed() is True and c.failed() is False


def test_one_address_always_backs_off() -> None:
    c = Controls([A])
    assert c.failed() is False and c.current == A
    assert c.failed(("n2", B.link)) is False and c.current == A  # not ours: never dialled


def test_a_follower_that_names_the_leader_sends_the_agent_there() -> None:
    c = Controls([A, B, C])
    assert c.failed(("n3", C.link)) is True and c.current == C
    # a name the agent was not given moves it to its own next address, not to the name
    c = Controls([A, B, C])
    assert c.failed(("evil", "203.0.113.9:8120")) is True and c.current == B
    # two followers naming each other count as tries: the agent backs off, it does not spin
    c = Controls([A, B])
    assert c.failed(("n2", B.link)) is True and c.current == B
    assert c.failed(("n1", A.link)) is False and c.current == A


def test_the_leader_hint_is_read_from_trailing_metadata() -> None:
    assert leader_hint(((LEADER_METADATA, "n2 10.9.0.2:8120"),)) == ("n2", "10.9.0.2:8120")
    assert leader_hint(((LEADER_METADATA, b"n2 h:1"), ("other", "x"))) == ("n2", "h:1")
    assert leader_hint(((LEADER_METADATA, "garbage"),)) is None
    assert leader_hint(None) is None and leader_hint(()) is None
