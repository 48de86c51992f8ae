"""Configuration: defaults work, bad keys and values fail naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentic_sandbox.broker.config import ConfigError, load_settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("SANDBOX_"):
            monkeypatch.delenv(key)


def test_defaults_work_on_one_machine() -> None:
    s = load_settings()
    assert s.http_listen == "127.0.0.1:8122"
    assert s.grpc_listen == "127.0.0.1:8120"
    assert s.libvirt_uri == "qemu:///system"
    assert s.effective_database_url.startswith("sqlite+aiosqlite:///")
    assert s.effective_database_url.endswith("/sandbox.db")
    assert s.effective_public_url == "http://127.0.0.1:8122"
    assert s.effective_admin_token_file == s.data_dir / "admin-token"


def test_unknown_environment_variable_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDBOX_HTTP_LISTN", "127.0.0.1:9000")
    with pytest.raises(ConfigError, match="SANDBOX_HTTP_LISTN"):
        load_settings()


def test_invalid_environment_value_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDBOX_HTTP_LISTEN", "localhost:http")
    with pytest.raises(ConfigError, match=r"http_listen \(environment SANDBOX_HTTP_LISTEN\)"):
        load_settings()


def test_unknown_key_in_toml_is_named(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('http_listen = "127.0.0.1:9000"\nlibvirt_url = "qemu:///system"\n')
    with pytest.raises(ConfigError, match="unknown setting 'libvirt_url'"):
        load_settings(f)


def test_invalid_value_in_toml_names_key_and_file(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("max_body_bytes = 12\n")
    with pytest.raises(ConfigError, match=r"max_body_bytes \(in .*c.toml\)"):
        load_settings(f)


def test_broken_toml_and_missing_file(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("http_listen = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(f)
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings(tmp_path / "missing.toml")


def test_environment_wins_over_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "c.toml"
    f.write_text('http_listen = "127.0.0.1:9000"\nlog_level = "debug"\n')
    monkeypatch.setenv("SANDBOX_HTTP_LISTEN", "127.0.0.1:9100")
    s = load_settings(f)
    assert s.http_listen == "127.0.0.1:9100"
    assert s.log_level == "DEBUG"


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("SANDBOX_DATABASE_URL", "mysql://x", "database_url"),
        ("SANDBOX_PUBLIC_URL", "ftp://host", "public_url"),
        ("SANDBOX_DATA_DIR", "relative/dir", "data_dir"),
        ("SANDBOX_METRICS_ACCESS", "everyone", "metrics_access"),
        ("SANDBOX_LOG_LEVEL", "LOUD", "log_level"),
    ],
)
def test_each_bad_value_is_refused(
    monkeypatch: pytest.MonkeyPatch, key: str, value: str, fragment: str
) -> None:
    monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=fragment):
        load_settings()


def test_server_exits_2_with_the_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from agentic_sandbox.broker.main import main

    monkeypatch.setenv("SANDBOX_GRPC_LISTEN", "nope")
    assert main(["check-config"]) == 2
    err = capsys.readouterr().err
    assert "grpc_listen" in err and "SANDBOX_GRPC_LISTEN" in err


def test_node_name_defaults_to_the_host_name_and_is_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import socket

    assert load_settings().node_name == socket.gethostname().split(".", 1)[0]
    monkeypatch.setenv("SANDBOX_NODE_NAME", "cp-2.example")
    assert load_settings().node_name == "cp-2.example"
    monkeypatch.setenv("SANDBOX_NODE_NAME", "bad name/../x")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert "node_name" in str(info.value) and "SANDBOX_NODE_NAME" in str(info.value)


def test_guest_link_addresses_are_ip_literals_bound_beside_guest_link_listen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = load_settings()
    assert s.guest_link_hosts == ["127.0.0.1"]
    assert s.guest_link_reaches("127.0.0.1") and not s.guest_link_reaches("198.18.0.1")
    monkeypatch.setenv("SANDBOX_GUEST_LINK_ADDRESSES", '["198.18.0.1", "fd00::0:1", "127.0.0.1"]')
    s = load_settings()
    assert s.guest_link_hosts == ["127.0.0.1", "198.18.0.1", "fd00::1"]
    assert s.guest_link_reaches("198.18.0.1") and s.guest_link_reaches("fd00::1")
    assert not s.guest_link_reaches("198.18.0.5")
    monkeypatch.setenv("SANDBOX_GUEST_LINK_LISTEN", "0.0.0.0:8124")
    monkeypatch.setenv("SANDBOX_GUEST_LINK_ADDRESSES", "[]")
    s = load_settings()
    assert s.guest_link_reaches("198.18.0.5") and not s.guest_link_reaches("fd00::1")
    for bad in ('["gateway.example"]', '["0.0.0.0"]', '["198.18.0.1:8124"]'):
        monkeypatch.setenv("SANDBOX_GUEST_LINK_ADDRESSES", bad)
        with pytest.raises(ConfigError, match="SANDBOX_GUEST_LINK_ADDRESSES"):
            load_settings()
