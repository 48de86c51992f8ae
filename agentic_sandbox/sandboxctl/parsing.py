"""The parser's pieces: global options that work in any position, nouns and verbs.

Global options (`--server`, `--token`, `--context`, `-o/--output`) are added afresh to the
top parser, every noun and every verb, each with no default of its own (argparse's SUPPRESS):
an option given anywhere lands in the namespace, a later position wins, and `defaults()` fills
in what was given nowhere. (Sharing one set of option objects through `parents=` and setting
their defaults on the top parser made every verb's copy reset them: `sandboxctl -o json
session new ID` printed a table.)
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from typing import Any

from agentic_sandbox.sandboxctl.exits import EXIT_USAGE, CliError
from agentic_sandbox.sdk import AsyncClient

Handler = Callable[[AsyncClient, argparse.Namespace], Awaitable[int | None]]
Group = argparse._SubParsersAction

GLOBAL_DEFAULTS: dict[str, Any] = {
    "server": None,
    "token": None,
    "context": None,
    "output": "table",
}


def add_global_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("global options (anywhere on the line)")
    g.add_argument(
        "--server",
        default=argparse.SUPPRESS,
        help="server URL, or several nodes of one cluster comma-separated (default: the "
        "context's, or $SANDBOX_URL)",
    )
    g.add_argument(
        "--token",
        default=argparse.SUPPRESS,
        help="operator token (default: the context's, or $SANDBOX_TOKEN)",
    )
    g.add_argument(
        "--context", default=argparse.SUPPRESS, help="use this context instead of the current one"
    )
    g.add_argument(
        "-o",
        "--output",
        choices=["table", "json", "yaml"],
        default=argparse.SUPPRESS,
        help="table (default), json or yaml",
    )


def defaults(args: argparse.Namespace) -> argparse.Namespace:
    for key, value in GLOBAL_DEFAULTS.items():
        if not hasattr(args, key):
            setattr(args, key, value)
    return args


class Nouns:
    """`noun(name)` → its verbs group; `verb(group, name, handler)` → the verb's parser."""

    def __init__(self, top: argparse.ArgumentParser) -> None:
        self.group = top.add_subparsers(dest="noun", metavar="NOUN")

    def noun(self, name: str, help_text: str) -> Group:
        sp = self.group.add_parser(name, help=help_text, description=help_text)
        add_global_options(sp)
        verbs: Group = sp.add_subparsers(dest="verb", metavar="VERB", required=True)
        return verbs

    def single(self, name: str, fn: Handler | None, help_text: str) -> argparse.ArgumentParser:
        """A noun without verbs (`whoami`)."""
        sp = self.group.add_parser(name, help=help_text, description=help_text)
        add_global_options(sp)
        sp.set_defaults(fn=fn, verb=name)
        return sp

    @staticmethod
    def verb(
        group: Group, name: str, fn: Handler | None, help_text: str
    ) -> argparse.ArgumentParser:
        vp: argparse.ArgumentParser = group.add_parser(name, help=help_text, description=help_text)
        add_global_options(vp)
        vp.set_defaults(fn=fn)
        return vp


def wait_options(p: argparse.ArgumentParser, what: str = "the operation") -> None:
    """`--wait` (the default) follows the operation to its end; `--no-wait` prints it at once."""
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--wait",
        dest="wait",
        action="store_true",
        default=True,
        help=f"follow {what} to its end with progress (default)",
    )
    g.add_argument("--no-wait", dest="wait", action="store_false", help=f"print {what} at once")


def kv(pairs: list[str], what: str) -> dict[str, str]:
    out = {}
    for p in pairs:
        key, sep, value = p.partition("=")
        if not sep or not key:
            raise CliError(f"{what} must be KEY=VALUE, got {p!r}", EXIT_USAGE)
        out[key] = value
    return out
