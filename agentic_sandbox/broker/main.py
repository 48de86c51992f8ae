"""`sandbox-server`: run the management server, or migrate its database."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from agentic_sandbox.broker.config import ConfigError, EventLoop, Settings, load_settings
from agentic_sandbox.broker.observability.logs import configure_logging
from agentic_sandbox.proto.grpc_io import use_polling_io


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sandbox-server",
        description="agentic-sandbox management server (HTTP + agent-link gRPC on one loop). "
        "Settings come from SANDBOX_* environment variables and an optional TOML file.",
    )
    p.add_argument("--config", type=Path, help="TOML file with settings (environment wins)")
    sub = p.add_subparsers(dest="command")
    sub.add_parser("serve", help="run the server (the default)")
    mig = sub.add_parser("migrate", help="migrate the database and exit")
    mig.add_argument("revision", nargs="?", default="head", help="target revision (default head)")
    sub.add_parser("check-config", help="validate the configuration, print it and exit")
    return p


def _run(coro_factory: object, settings: Settings) -> None:
    use_uvloop = settings.event_loop is EventLoop.uvloop
    if settings.event_loop is EventLoop.auto:
        try:
            import uvloop

            use_uvloop = True
        except ImportError:
            use_uvloop = False
    if use_uvloop:
        import uvloop

        uvloop.run(coro_factory())  # type: ignore[operator]
    else:
        asyncio.run(coro_factory())  # type: ignore[operator]


def main(argv: list[str] | None = None) -> int:
    use_polling_io()  # before gRPC loads (the agent link's listeners)
    args = _parser().parse_args(argv)
    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        print(f"sandbox-server: {exc}", file=sys.stderr)
        return 2
    command = args.command or "serve"
    if command == "serve":  # gRPC's C core (and any native library) logs to fd 2 directly
        from agentic_sandbox.broker.observability.native_log import route_native_stderr

        route_native_stderr(settings.log_level, settings.log_format)
    configure_logging(settings.log_level, settings.log_format)

    if command == "check-config":
        print(settings.model_dump_json(indent=2))
        return 0

    if command == "migrate":
        from agentic_sandbox.broker.store import Database

        async def migrate() -> None:
            db = Database(settings.effective_database_url)
            try:
                await db.migrate(args.revision)
                print(f"database at revision {await db.current_revision()}")
            finally:
                await db.close()

        _run(migrate, settings)
        return 0

    from agentic_sandbox.broker.app import StartupError
    from agentic_sandbox.broker.server import Server

    exit_code = 0

    async def serve() -> None:
        nonlocal exit_code
        exit_code = await Server(settings).run_forever()

    try:
        _run(serve, settings)
    except KeyboardInterrupt:
        return 130
    except StartupError as exc:
        print(f"sandbox-server: start-up failed: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # start-up failure: one clear line, details in the log
        logging.getLogger("broker").exception("start-up failed")
        print(f"sandbox-server: start-up failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
