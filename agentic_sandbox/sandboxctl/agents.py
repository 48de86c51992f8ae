"""Verbs of the agents: list them, the bundles a rollout can send, upload one, roll one out."""

from __future__ import annotations

import argparse
from pathlib import Path

from agentic_sandbox.sandboxctl.exits import EXIT_USAGE, CliError
from agentic_sandbox.sandboxctl.fleet import follow_operation
from agentic_sandbox.sandboxctl.output import doc, emit
from agentic_sandbox.sandboxctl.parsing import Nouns, wait_options
from agentic_sandbox.sdk import AsyncClient

AGENT_COLS = ["instance_id", "state", "agent_version", "agent_bundle", "bundle_problem"]
BUNDLE_COLS = ["digest", "version", "size", "builtin", "created_by", "created_at"]
MAX_BUNDLE = 32 * 1024 * 1024  # what the server takes


async def agent_list(c: AsyncClient, a: argparse.Namespace) -> None:
    emit(doc(await c.agents.list()), a.output, AGENT_COLS)


async def agent_bundles(c: AsyncClient, a: argparse.Namespace) -> None:
    emit(doc(await c.agents.bundles()), a.output, BUNDLE_COLS)


async def agent_upload_bundle(c: AsyncClient, a: argparse.Namespace) -> None:
    path = Path(a.file).expanduser()
    try:
        size = path.stat().st_size
        if size > MAX_BUNDLE:
            raise CliError(f"{path}: {size} bytes; a bundle is at most {MAX_BUNDLE}", EXIT_USAGE)
        data = path.read_bytes()
    except OSError as exc:
        raise CliError(f"{path}: {exc.strerror or exc}", EXIT_USAGE) from None
    emit(doc(await c.agents.upload_bundle(data)), a.output)


async def agent_rollout(c: AsyncClient, a: argparse.Namespace) -> int:
    op = await c.agents.rollout(
        bundle=a.bundle, instances=a.instance, trial_seconds=a.trial_seconds
    )
    return await follow_operation(c, op, a.output, wait=a.wait)


def register(nouns: Nouns) -> None:
    verb = nouns.verb
    g = nouns.noun("agent", "the instances' agents, and agent upgrades")
    verb(g, "list", agent_list, "list agents: state, version and the bundle each runs")
    verb(g, "bundles", agent_bundles, "list the bundles a rollout can send (the server's first)")
    v = verb(g, "upload-bundle", agent_upload_bundle, "upload an agent bundle (.tar.gz)")
    v.add_argument("file")
    v = verb(g, "rollout", agent_rollout, "roll a bundle out to running instances, one at a time")
    v.add_argument("--bundle", help="the bundle's digest (default: the server's own agent)")
    v.add_argument(
        "--instance",
        action="append",
        help="an instance, in order (repeatable; default: every connected agent)",
    )
    v.add_argument(
        "--trial-seconds",
        type=int,
        help="how long each new agent has to link before it is rolled back (default 120)",
    )
    wait_options(v, "the rollout")
