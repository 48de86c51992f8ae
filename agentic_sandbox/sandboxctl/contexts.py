"""Named server contexts (URL + token file) in ~/.config/agentic-sandbox/sandboxctl.yaml.

`SANDBOX_URL` / `SANDBOX_TOKEN` (or `--server` / `--token`) override the current context.
Tokens are stored as files with mode 0600, never in the YAML itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from agentic_sandbox.sandboxctl.client import EXIT_USAGE, CliError, Target

DEFAULT_URL = "http://127.0.0.1:8122"


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
            raise CliError(f"{path} is not valid YAML: {exc}") from None
        return cls(doc.get("current-context"), dict(doc.get("contexts") or {}))

    def save(self) -> None:
        path = config_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {"current-context": self.current, "contexts": self.items}
        path.write_text(yaml.safe_dump(doc, sort_keys=True))

    def set(self, name: str, url: str, token: str | None, token_file: str | None) -> None:
        entry: dict[str, Any] = {"url": url.rstrip("/")}
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
    for candidate in (
        Path(os.environ.get("SANDBOX_DATA_DIR", "/var/lib/agentic-sandbox")) / "admin-token",
        Path.home() / ".local/share/agentic-sandbox/admin-token",
    ):
        if candidate.is_file() and os.access(candidate, os.R_OK):
            return candidate
    return None


def resolve_target(server: str | None, token: str | None, context: str | None) -> Target:
    ctxs = Contexts.load()
    name = context or os.environ.get("SANDBOX_CONTEXT") or ctxs.current
    entry: dict[str, Any] = {}
    if name is not None:
        if name not in ctxs.items:
            raise CliError(
                f"unknown context {name!r} (see `sandboxctl config get-contexts`)", EXIT_USAGE
            )
        entry = ctxs.items[name]
    url = server or os.environ.get("SANDBOX_URL") or entry.get("url") or DEFAULT_URL
    tok = token or os.environ.get("SANDBOX_TOKEN")
    if tok is None and entry.get("token_file"):
        try:
            tok = Path(entry["token_file"]).read_text().strip()
        except OSError as exc:
            raise CliError(
                f"cannot read token file {entry['token_file']}: {exc.strerror}"
            ) from None
    if tok is None and not entry:
        local = default_token_file()
        if local is not None:
            tok = local.read_text().strip()
    return Target(url.rstrip("/"), tok)
