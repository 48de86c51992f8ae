"""Verbs of sessions and tasks."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from agentic_sandbox.sandboxctl.output import doc, emit
from agentic_sandbox.sandboxctl.parsing import Nouns, kv
from agentic_sandbox.sdk import AsyncClient

SESSION_COLS = ["id", "instance_id", "state", "name", "controller", "observers", "exit_code"]
TASK_COLS = ["id", "instance_id", "state", "owner", "created_at"]


async def session_list(c: AsyncClient, a: argparse.Namespace) -> None:
    sessions = await c.sessions.list(instance_id=a.instance, state=a.state)
    emit(doc(sessions), a.output, SESSION_COLS)


async def session_new(c: AsyncClient, a: argparse.Namespace) -> None:
    size = shutil.get_terminal_size((80, 24))
    session = await c.sessions.create(
        a.instance,
        a.command or None,
        name=a.name or "",
        env=kv(a.env, "--env") if a.env else None,
        cols=size.columns,
        rows=size.lines,
    )
    emit(doc(session), a.output)


async def session_kill(c: AsyncClient, a: argparse.Namespace) -> None:
    await c.sessions.kill(a.id)
    print(f"killed {a.id}")


async def session_screen(c: AsyncClient, a: argparse.Namespace) -> None:
    screen = await c.sessions.screen(a.id)
    if a.output == "table":
        print(screen.text)
    else:
        emit(doc(screen), a.output)


async def session_record(c: AsyncClient, a: argparse.Namespace) -> None:
    raw = await c.sessions.recording(a.id)
    if a.file == "-":
        sys.stdout.buffer.write(raw)
    else:
        Path(a.file).write_bytes(raw)
        print(f"wrote {len(raw)} bytes to {a.file} (asciicast v2; play with `asciinema play`)")


async def session_attach(c: AsyncClient, a: argparse.Namespace) -> int:
    from agentic_sandbox.sandboxctl.attach import attach

    return await attach(c, a.id, observe=a.observe, force=a.force, detach_key=a.detach_key)


async def task_send(c: AsyncClient, a: argparse.Namespace) -> None:
    emit(doc(await c.tasks.send(a.instance, a.text)), a.output)


async def task_list(c: AsyncClient, a: argparse.Namespace) -> None:
    emit(doc(await c.tasks.list(instance_id=a.instance, state=a.state)), a.output, TASK_COLS)


async def task_get(c: AsyncClient, a: argparse.Namespace) -> None:
    emit(doc(await c.tasks.get(a.id)), a.output)


async def task_cancel(c: AsyncClient, a: argparse.Namespace) -> None:
    emit(doc(await c.tasks.cancel(a.id)), a.output)


async def task_watch(c: AsyncClient, a: argparse.Namespace) -> None:
    async for ev in c.tasks.logs(a.id):
        text = ev.data.get("text")
        print(text if isinstance(text, str) else json.dumps(ev.data), flush=True)


def register(nouns: Nouns) -> None:
    verb = nouns.verb
    g = nouns.noun("session", "PTY sessions")
    v = verb(g, "list", session_list, "list sessions")
    v.add_argument("--instance")
    v.add_argument("--state")
    v = verb(g, "new", session_new, "open a session (login shell, or a command after --)")
    v.add_argument("instance")
    v.add_argument("--name")
    v.add_argument("--env", action="append", help="KEY=VALUE (repeatable)")
    v.add_argument("command", nargs="*")
    v = verb(g, "attach", session_attach, "attach this terminal (detach with Ctrl-])")
    v.add_argument("id")
    v.add_argument("--observe", action="store_true", help="watch only")
    v.add_argument("--force", action="store_true", help="take control from the current controller")
    v.add_argument("--detach-key", default="ctrl-]", help="e.g. ctrl-], ctrl-q")
    verb(g, "kill", session_kill, "kill a session").add_argument("id")
    verb(g, "screen", session_screen, "print the current screen").add_argument("id")
    v = verb(g, "record", session_record, "download the asciicast recording")
    v.add_argument("id")
    v.add_argument("file", nargs="?", default="-")

    g = nouns.noun("task", "A2A tasks (missions)")
    v = verb(g, "send", task_send, "send a task to an instance")
    v.add_argument("instance")
    v.add_argument("text")
    v = verb(g, "list", task_list, "list tasks")
    v.add_argument("--instance")
    v.add_argument("--state")
    verb(g, "get", task_get, "show a task").add_argument("id")
    verb(g, "cancel", task_cancel, "cancel a task").add_argument("id")
    verb(g, "watch", task_watch, "follow a task's output").add_argument("id")
