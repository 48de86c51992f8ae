"""`agent-client`: the in-guest agent (also runnable on the host for development and tests)."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

from agentic_sandbox.agent.config import ConfigError, load, parser
from agentic_sandbox.agent.keeper import ENV_FD, EXIT_RESTART, run_keeper
from agentic_sandbox.proto.grpc_io import use_polling_io

# The agent forks only to exec (ptyprocess); gRPC's fork handlers are not needed and only log.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
use_polling_io()  # before gRPC loads; the keeper's workers inherit it

if TYPE_CHECKING:
    from agentic_sandbox.agent.runtime import AgentRuntime

_STD = frozenset(vars(logging.LogRecord("x", 0, "x", 0, "x", None, None)).keys()) | {"message"}


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def _configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


async def _serve(runtime: AgentRuntime) -> None:
    import asyncio

    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)

    def hand_over() -> None:  # the keeper's SIGHUP: a planned restart keeps the sessions
        if runtime.keeper is not None and runtime.keeper.alive:
            runtime.handing_over = True
        task.cancel()

    loop.add_signal_handler(signal.SIGHUP, hand_over)
    await runtime.run()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        cfg = load(args)
    except ConfigError as exc:
        print(f"agent-client: {exc}", file=sys.stderr)
        return 2
    if cfg.session_keeper and ENV_FD not in os.environ:
        # the first process: keep the sessions while the worker (this command again) runs
        return run_keeper(
            [sys.executable, "-m", "agentic_sandbox.agent.main", *sys.argv[1:]],
            cfg.state_dir / "bundles",
        )
    _configure_logging(cfg.log_level, cfg.log_format)
    # only the worker loads asyncio, gRPC and the rest: the keeper stays small
    import asyncio

    from agentic_sandbox.agent.runtime import AgentRuntime

    runtime = AgentRuntime(cfg)
    try:
        asyncio.run(_serve(runtime))
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass
    return EXIT_RESTART if runtime.handing_over else 0


if __name__ == "__main__":
    sys.exit(main())
