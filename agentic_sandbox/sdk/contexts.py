"""Where a client finds its server and token: named contexts, as sandboxctl keeps them.

Contexts (a URL and a token file each) live in `~/.config/agentic-sandbox/sandboxctl.yaml`
(`$XDG_CONFIG_HOME` moves it); tokens are files with mode 0600, never in the YAML itself.
`Credentials.resolve()` picks, first match wins:

- the URL: the `server` argument, `$SANDBOX_URL`, the context's (`url`, or `servers: [..]`),
  `http://127.0.0.1:8122`. Several nodes of one cluster are comma-separated
  (`SANDBOX_URL=http://a:8122,http://b:8122`): the client finds and follows the leader;
- the token: the `token` argument, `$SANDBOX_TOKEN`, the context's token file, and with no
  context at all the local server's admin token file (`$SANDBOX_DATA_DIR/admin-token`, then
  `/var/lib/agentic-sandbox/admin-token`, `~/.local/share/agentic-sandbox/admin-token`), when
  this user may read it;
- the context: the `context` argument, `$SANDBOX_CONTEXT`, the file's current one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from agentic_sandbox.sdk.errors import ConfigError

DEFAULT_URL = "http://127.0.0.1:8122"


class UnknownContext(ConfigError):
    """A context name that the contexts file does not have."""


def config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "agentic-sandbox"


def config_path() -> Path:
    return config_dir() / "sandboxctl.yaml"


@dataclass
class Contexts:
    current: str | None
    items: dict[str, dict[str, Any]]

    @classmethod
    def load(cls) -> Contexts:
        path = config_path()
        if not path.exists():
            return cls(None, {})
        try:
            doc = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path} is not valid YAML: {exc}") from None
        return cls(doc.get("current-context"), dict(doc.get("contexts") or {}))

    def save(self) -> None:
        path = config_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {"current-context": self.current, "contexts": self.items}
        path.write_text(yaml.safe_dump(doc, sort_keys=True))

    def set(self, name: str, url: str, token: str | None, token_file: str | None) -> None:
        urls = [u.strip().rstrip("/") for u in url.split(",") if u.strip()]
        entry: dict[str, Any] = {"url": urls[0]} if len(urls) == 1 else {"servers": urls}
        if token is not None:
            tf = config_dir() / "tokens" / name
            tf.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(token + "\n")
            entry["token_file"] = str(tf)
        elif token_file is not None:
            entry["token_file"] = str(Path(token_file).expanduser().resolve())
        self.items[name] = entry
        if self.current is None:
            self.current = name


def default_token_file() -> Path | None:
    """The local server's admin token file, if this user may read it."""
    candidates = (
        [Path(os.environ["SANDBOX_DATA_DIR"]) / "admin-token"]
        if os.environ.get("SANDBOX_DATA_DIR")
        else []
    )
    candidates += [
        Path("/var/lib/agentic-sandbox/admin-token"),
        Path.home() / ".local/share/agentic-sandbox/admin-token",
    ]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.R_OK):
            return candidate
    return None


@dataclass(frozen=True)
class Credentials:
    """A server's base URL and the bearer token to call it with."""

    url: str  # one base URL, or several (comma-separated) nodes of one cluster
    token: str | None

    @classmethod
    def resolve(
        cls, server: str | None = None, token: str | None = None, context: str | None = None
    ) -> Credentials:
        ctxs = Contexts.load()
        name = context or os.environ.get("SANDBOX_CONTEXT") or ctxs.current
        entry: dict[str, Any] = {}
        if name is not None:
            if name not in ctxs.items:
                raise UnknownContext(
                    f"unknown context {name!r} (see `sandboxctl config get-contexts`)"
                )
            entry = ctxs.items[name]
        servers = entry.get("servers")
        ctx_url = ",".join(map(str, servers)) if isinstance(servers, list) else entry.get("url")
        url = server or os.environ.get("SANDBOX_URL") or ctx_url or DEFAULT_URL
        tok = token or os.environ.get("SANDBOX_TOKEN")
        if tok is None and entry.get("token_file"):
            try:
                tok = Path(entry["token_file"]).read_text().strip()
            except OSError as exc:
                raise ConfigError(
                    f"cannot read token file {entry['token_file']}: {exc.strerror}"
                ) from None
        if tok is None and not entry:
            local = default_token_file()
            if local is not None:
                tok = local.read_text().strip()
        return cls(",".join(u.strip().rstrip("/") for u in url.split(",") if u.strip()), tok)
