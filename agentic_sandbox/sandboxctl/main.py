"""`sandboxctl`: the operator CLI. Noun first, then verb: `sandboxctl instance list`.

It speaks the server's HTTP and WebSocket API through the Python SDK (`agentic_sandbox.sdk`).
Global options (--server, --token, --context, -o) work anywhere on the line. Exit codes: 0 ok,
1 error, 2 usage, 3 not found, 4 not authenticated/allowed, 5 conflict, 6 invalid input,
7 server unavailable or over a limit.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from agentic_sandbox.sandboxctl import admin, agents, fleet, sessions
from agentic_sandbox.sandboxctl.exits import EXIT_OK, EXIT_USAGE, CliError, exit_code
from agentic_sandbox.sandboxctl.output import emit, err
from agentic_sandbox.sandboxctl.parsing import Nouns, add_global_options, defaults
from agentic_sandbox.sdk import AsyncClient, Contexts, Credentials, SandboxError
from agentic_sandbox.sdk.contexts import config_path


# ---- verbs without a server ------------------------------------------------------------------
def _url_of(entry: dict[str, object]) -> dict[str, object]:
    """A context's fields, its `servers` list shown as one comma-separated `url`."""
    servers = entry.get("servers")
    if isinstance(servers, list):
        return {**{k: v for k, v in entry.items() if k != "servers"}, "url": ",".join(servers)}
    return entry


def cmd_config(args: argparse.Namespace) -> int:
    ctxs = Contexts.load()
    if args.verb == "set-context":
        if not args.server:
            raise CliError(
                "set-context needs --server URL (and --token or --token-file)", EXIT_USAGE
            )
        ctxs.set(args.name, args.server, args.token, args.token_file)
        if args.use:
            ctxs.current = args.name
        ctxs.save()
        print(f"context {args.name!r} saved in {config_path()}")
    elif args.verb == "use-context":
        if args.name not in ctxs.items:
            raise CliError(f"unknown context {args.name!r}", EXIT_USAGE)
        ctxs.current = args.name
        ctxs.save()
        print(f"now using {args.name!r}")
    else:
        rows = [
            {"current": "*" if n == ctxs.current else "", "name": n, **_url_of(v)}
            for n, v in sorted(ctxs.items.items())
        ]
        emit(
            {"items": rows} if args.output != "table" else rows,
            args.output,
            ["current", "name", "url", "token_file"],
        )
    return EXIT_OK


def cmd_completion(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import shtab  # only here: the other verbs need not pay for it

    print(shtab.complete(parser, shell=args.shell))
    return EXIT_OK


# ---- the parser ----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sandboxctl",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_global_options(p)
    nouns = Nouns(p)
    verb = nouns.verb

    g = nouns.noun("config", "server contexts (URL + token)")
    v = verb(g, "set-context", None, "create or update a context")
    v.add_argument("name")
    v.add_argument("--token-file")
    v.add_argument("--use", action="store_true", help="also make it current")
    verb(g, "use-context", None, "switch the current context").add_argument("name")
    verb(g, "get-contexts", None, "list contexts")

    fleet.register(nouns)
    sessions.register(nouns)
    admin.register(nouns)
    agents.register(nouns)

    g = nouns.noun("completion", "shell completion")
    for shell in ("bash", "zsh"):
        v = verb(g, shell, None, f"print the {shell} completion script")
        v.set_defaults(shell=shell)
    g.metavar = "SHELL"
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after `--` is a command to run (session new, instance ssh), options or not.
    trailing: list[str] | None = None
    if "--" in argv:
        cut = argv.index("--")
        argv, trailing = argv[:cut], argv[cut + 1 :]
    args = defaults(parser.parse_args(argv))
    if trailing is not None:
        if not hasattr(args, "command"):
            parser.error("`--` is only for commands (session new, instance ssh)")
        args.command = [*(args.command or []), *trailing]
    if args.noun is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        if args.noun == "config":
            return cmd_config(args)
        if args.noun == "completion":
            return cmd_completion(args, parser)
        credentials = Credentials.resolve(args.server, args.token, args.context)

        async def run() -> int | None:
            async with AsyncClient(credentials=credentials) as client:
                return await args.fn(client, args)

        return asyncio.run(run()) or EXIT_OK
    except CliError as exc:
        err(str(exc))
        return exc.code
    except SandboxError as exc:
        err(str(exc))
        return exit_code(exc)
    except KeyboardInterrupt:
        return 130
    except OSError as exc:
        err(str(exc))
        return 1


if __name__ == "__main__":
    sys.exit(main())
