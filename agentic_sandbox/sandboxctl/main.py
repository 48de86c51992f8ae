"""`sandboxctl`: the operator CLI. Noun first, then verb: `sandboxctl instance list`.

It speaks only the server's HTTP and WebSocket API. Exit codes: 0 ok, 1 error, 2 usage,
3 not found, 4 not authenticated/allowed, 5 conflict, 6 invalid input, 7 server unavailable or
over a limit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from agentic_sandbox.sandboxctl.client import (
    EXIT_AUTH,
    EXIT_OK,
    EXIT_USAGE,
    Api,
    CliError,
    Target,
)
from agentic_sandbox.sandboxctl.contexts import Contexts, config_path, resolve_target
from agentic_sandbox.sandboxctl.exec import add_arguments as exec_arguments
from agentic_sandbox.sandboxctl.exec import instance_exec
from agentic_sandbox.sandboxctl.output import emit, err, progress

Handler = Callable[[Api, argparse.Namespace], Awaitable[int | None]]

INSTANCE_COLS = ["id", "state", "agent_state", "host", "loadout", "vcpus", "memory_mib", "owner"]
SESSION_COLS = ["id", "instance_id", "state", "name", "controller", "observers", "exit_code"]
TASK_COLS = ["id", "instance_id", "state", "owner", "created_at"]
TOKEN_COLS = ["id", "subject", "role", "prefix", "created_at", "expires_at", "revoked_at"]


def _kv(pairs: list[str], what: str) -> dict[str, str]:
    out = {}
    for p in pairs:
        key, sep, value = p.partition("=")
        if not sep or not key:
            raise CliError(f"{what} must be KEY=VALUE, got {p!r}", EXIT_USAGE)
        out[key] = value
    return out


# ---- config ------------------------------------------------------------------------------------
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
            {"current": "*" if n == ctxs.current else "", "name": n, **v}
            for n, v in sorted(ctxs.items.items())
        ]
        emit(
            {"items": rows} if args.output != "table" else rows,
            args.output,
            ["current", "name", "url", "token_file"],
        )
    return EXIT_OK


# ---- handlers over the API ---------------------------------------------------------------------
async def whoami(api: Api, a: argparse.Namespace) -> None:
    emit(await api.get("/api/v2/admin/whoami"), a.output)


async def token_create(api: Api, a: argparse.Namespace) -> None:
    body: dict[str, Any] = {"subject": a.subject, "role": a.role, "description": a.description}
    if a.expires_in:
        body["expires_in_seconds"] = a.expires_in
    created = await api.post("/api/v2/admin/tokens", body)
    if a.output == "table":
        print(created["token"])
        print(
            f"(token {created['id']} for {created['subject']} as {created['role']}; "
            "shown once — store it now)",
            file=sys.stderr,
        )
    else:
        emit(created, a.output)


async def token_list(api: Api, a: argparse.Namespace) -> None:
    emit(await api.get("/api/v2/admin/tokens"), a.output, TOKEN_COLS)


async def token_revoke(api: Api, a: argparse.Namespace) -> None:
    await api.delete(f"/api/v2/admin/tokens/{a.token_id}")
    print(f"revoked {a.token_id}")


async def secret_set(api: Api, a: argparse.Namespace) -> None:
    if a.from_file:
        value = Path(a.from_file).read_text()
    elif a.value == "-":
        value = sys.stdin.read()
    else:
        value = a.value
    body: dict[str, Any] = {"value": value, "instances": a.instance or []}
    if a.env:
        body["env_name"] = a.env
    info = await api.put(f"/api/v2/admin/secrets/{a.name}", body)
    emit(info, a.output)


async def secret_list(api: Api, a: argparse.Namespace) -> None:
    emit(
        await api.get("/api/v2/admin/secrets"),
        a.output,
        ["name", "owner", "version", "instances", "updated_at"],
    )


async def secret_delete(api: Api, a: argparse.Namespace) -> None:
    await api.delete(f"/api/v2/admin/secrets/{a.name}")
    print(f"deleted {a.name}")


async def event_tail(api: Api, a: argparse.Namespace) -> None:
    params: dict[str, Any] = {"after": a.after}
    if a.type:
        params["type"] = ",".join(a.type)
    if a.instance:
        params["instance_id"] = a.instance
    if not a.follow:
        page = await api.get("/api/v1/events", limit=a.limit, **params)
        _print_events(page["items"], a.output)
        return
    async for ev in api.sse("/api/v1/events/stream", params):
        _print_events([ev], a.output)


def _print_events(items: list[dict[str, Any]], fmt: str) -> None:
    for ev in items:
        if fmt == "json":
            print(json.dumps(ev), flush=True)
        else:
            subject = ev.get("instance_id") or ev.get("session_id") or ev.get("task_id") or ""
            data = json.dumps(ev.get("data", {}), separators=(",", ":"))
            print(
                f"{ev['seq']:>8} {ev['time'][:19]} {ev['type']:<28} {subject:<20} {data}",
                flush=True,
            )


async def instance_list(api: Api, a: argparse.Namespace) -> None:
    emit(
        await api.get("/api/v2/admin/instances", state=a.state, host=a.host),
        a.output,
        INSTANCE_COLS,
    )


async def instance_get(api: Api, a: argparse.Namespace) -> None:
    emit(await api.get(f"/api/v2/admin/instances/{a.id}"), a.output)


async def instance_create(api: Api, a: argparse.Namespace) -> int:
    body: dict[str, Any] = {"id": a.id}
    for key in ("image", "loadout", "from_snapshot", "network"):
        value = getattr(a, key)
        if value is not None:
            body[key] = value
    res = {
        k: v
        for k, v in (("cpus", a.cpus), ("memory_mib", a.memory), ("disk_gib", a.disk))
        if v is not None
    }
    if res:
        body["resources"] = res
    if a.ssh_key:
        body["ssh_keys"] = [Path(p).expanduser().read_text().strip() for p in a.ssh_key]
    try:
        op = await api.post("/api/v2/admin/instances", body)
    except CliError as exc:
        recipe = exc.problem.get("recipe") if exc.problem.get("code") == "image-not-built" else None
        if recipe is None or a.no_build:
            raise
        await build_first(api, str(recipe), exc)
        op = await api.post("/api/v2/admin/instances", body)
    if a.no_wait:
        emit(op, a.output)
        return EXIT_OK
    return await follow_operation(api, op, a.output)


async def build_first(api: Api, recipe: str, refusal: CliError) -> None:
    """A create on a server that has not built its image yet: build it (what `image build`
    does, with the same progress line), then the create goes on."""
    print(
        f"image {recipe} is not built yet: building it first (`sandboxctl image build {recipe}`;"
        " ~90 s the first time, cached after)",
        file=sys.stderr,
    )
    try:
        op = await api.post("/api/v2/admin/images", {"recipe": recipe})
    except CliError as exc:
        if exc.code == EXIT_AUTH:
            raise CliError(
                f"{refusal}\nbuilding an image needs the admin role: ask an admin to run "
                f"`sandboxctl image build {recipe}`",
                EXIT_AUTH,
            ) from None
        raise
    await follow_operation(api, op, "table", show=False)
    print(f"image {recipe} is built", file=sys.stderr)


def _table_view(op: dict[str, Any]) -> dict[str, Any]:
    """An operation for a table: long diagnostics become a pointer to the full output."""
    error = op.get("error")
    if not isinstance(error, dict) or not error.get("diagnostics"):
        return op
    lines = str(error["diagnostics"]).count("\n") + 1
    brief = {**error, "diagnostics": f"{lines} lines (shown with -o yaml or -o json)"}
    return {**op, "error": brief}


async def follow_operation(api: Api, op: dict[str, Any], fmt: str, *, show: bool = True) -> int:
    """Poll an operation to its end with a progress line on stderr, then print it. A failed or
    canceled one also prints its stage and cause on stderr and exits non-zero."""
    with progress(f"{op['kind']} {op['subject_id']}") as update:
        while op["state"] not in ("succeeded", "failed", "canceled"):
            update(op.get("stage") or op["state"], float(op.get("progress") or 0.0))
            await asyncio.sleep(0.5)
            op = await api.get(f"/api/v2/admin/operations/{op['id']}")
        if op["state"] == "succeeded":
            update("done", 1.0)
    if show or op["state"] != "succeeded":
        emit(_table_view(op) if fmt == "table" else op, fmt)
    if op["state"] != "succeeded":
        error = op.get("error") or {}
        what = "was canceled" if op["state"] == "canceled" else "failed"
        stage = error.get("stage") or op.get("stage")
        raise CliError(
            f"{op['kind']} {op['subject_id']} {what} at stage {stage}: "
            f"{error.get('cause') or op['state']}"
        )
    return EXIT_OK


async def instance_action(api: Api, a: argparse.Namespace) -> None:
    res = await api.post(f"/api/v2/admin/instances/{a.id}/{a.verb}", {})
    emit(res if res is not None else {"id": a.id, "done": a.verb}, a.output)


async def instance_delete(api: Api, a: argparse.Namespace) -> None:
    await api.delete(f"/api/v2/admin/instances/{a.id}")
    print(f"deleted {a.id}")


async def instance_snapshot(api: Api, a: argparse.Namespace) -> None:
    body = {"name": a.name, "memory": a.memory}
    emit(await api.post(f"/api/v2/admin/instances/{a.id}/snapshots", body), a.output)


async def instance_clone(api: Api, a: argparse.Namespace) -> int:
    op = await api.post(
        f"/api/v2/admin/instances/{a.id}/clone", {"new_id": a.new_id, "snapshot": a.snapshot}
    )
    return await follow_operation(api, op, a.output)


async def instance_console(api: Api, a: argparse.Namespace) -> None:
    data = await api.get(f"/api/v2/admin/instances/{a.id}/console", tail=a.tail)
    sys.stdout.write(data["text"] if isinstance(data, dict) else data.decode(errors="replace"))


async def instance_ssh(api: Api, a: argparse.Namespace) -> int:
    info = await api.get(f"/api/v2/admin/instances/{a.id}")
    port = info.get("ssh_port")
    if not port:
        raise CliError(f"instance {a.id} has no SSH forward")
    argv = [
        "ssh",
        "-p",
        str(port),
        "-o",
        "StrictHostKeyChecking=accept-new",
        "agent@127.0.0.1",
        *a.command,
    ]
    import os

    os.execvp("ssh", argv)
    return EXIT_OK  # not reached


async def session_list(api: Api, a: argparse.Namespace) -> None:
    emit(
        await api.get("/api/v2/admin/sessions", instance_id=a.instance, state=a.state),
        a.output,
        SESSION_COLS,
    )


async def session_new(api: Api, a: argparse.Namespace) -> None:
    body: dict[str, Any] = {"instance_id": a.instance, "name": a.name or ""}
    if a.command:
        body["command"] = a.command
    if a.env:
        body["env"] = _kv(a.env, "--env")
    size = _terminal_size()
    body["cols"], body["rows"] = size
    emit(await api.post("/api/v2/admin/sessions", body), a.output)


async def session_kill(api: Api, a: argparse.Namespace) -> None:
    await api.post(f"/api/v2/admin/sessions/{a.id}/kill", {})
    print(f"killed {a.id}")


async def session_screen(api: Api, a: argparse.Namespace) -> None:
    screen = await api.get(f"/api/v2/admin/sessions/{a.id}/screen")
    if a.output == "table":
        print(screen.get("text", ""))
    else:
        emit(screen, a.output)


async def session_record(api: Api, a: argparse.Namespace) -> None:
    data = await api.get(f"/api/v2/admin/sessions/{a.id}/recording")
    raw = data if isinstance(data, bytes) else json.dumps(data).encode()
    if a.file == "-":
        sys.stdout.buffer.write(raw)
    else:
        Path(a.file).write_bytes(raw)
        print(f"wrote {len(raw)} bytes to {a.file} (asciicast v2; play with `asciinema play`)")


async def session_attach(api: Api, a: argparse.Namespace) -> int:
    from agentic_sandbox.sandboxctl.attach import attach

    return await attach(api, a.id, observe=a.observe, force=a.force, detach_key=a.detach_key)


async def task_send(api: Api, a: argparse.Namespace) -> None:
    body = {"instance_id": a.instance, "command": a.text}
    emit(await api.post("/api/v1/tasks", body), a.output)


async def task_list(api: Api, a: argparse.Namespace) -> None:
    emit(
        await api.get("/api/v2/admin/missions", instance_id=a.instance, state=a.state),
        a.output,
        TASK_COLS,
    )


async def task_get(api: Api, a: argparse.Namespace) -> None:
    emit(await api.get(f"/api/v2/admin/missions/{a.id}"), a.output)


async def task_cancel(api: Api, a: argparse.Namespace) -> None:
    emit(await api.delete(f"/api/v1/tasks/{a.id}"), a.output)


async def task_watch(api: Api, a: argparse.Namespace) -> None:
    async for ev in api.sse(f"/api/v1/tasks/{a.id}/logs", {}):
        text = ev.get("text") or ev.get("data") or ev
        print(text if isinstance(text, str) else json.dumps(text), flush=True)


async def image_build(api: Api, a: argparse.Namespace) -> int:
    op = await api.post("/api/v2/admin/images", {"recipe": a.recipe})
    return await follow_operation(api, op, a.output)


async def image_list(api: Api, a: argparse.Namespace) -> None:
    emit(
        await api.get("/api/v2/admin/images"),
        a.output,
        ["name", "kind", "state", "size_bytes", "created_at"],
    )


async def host_add(api: Api, a: argparse.Namespace) -> None:
    body: dict[str, Any] = {"name": a.name, "uri": a.uri, "labels": _kv(a.label or [], "--label")}
    emit(await api.post("/api/v2/admin/hosts", body), a.output)


async def host_list(api: Api, a: argparse.Namespace) -> None:
    emit(
        await api.get("/api/v2/admin/hosts"),
        a.output,
        ["name", "uri", "state", "labels", "free_memory_mib", "instances"],
    )


async def loadout_list(api: Api, a: argparse.Namespace) -> None:
    emit(await api.get("/api/v2/admin/loadouts"), a.output, ["name", "description", "network"])


async def loadout_show(api: Api, a: argparse.Namespace) -> None:
    emit(
        await api.get(f"/api/v2/admin/loadouts/{a.name}"),
        a.output if a.output != "table" else "yaml",
    )


def _terminal_size() -> tuple[int, int]:
    import shutil

    size = shutil.get_terminal_size((80, 24))
    return size.columns, size.lines


# ---- the parser ----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sandboxctl",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # The global options work before or after the noun and verb (`sandboxctl x list -o json`).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--server",
        default=argparse.SUPPRESS,
        help="server URL (default: the context's, or $SANDBOX_URL)",
    )
    common.add_argument(
        "--token",
        default=argparse.SUPPRESS,
        help="operator token (default: the context's, or $SANDBOX_TOKEN)",
    )
    common.add_argument(
        "--context", default=argparse.SUPPRESS, help="use this context instead of the current one"
    )
    common.add_argument(
        "-o",
        "--output",
        choices=["table", "json", "yaml"],
        default=argparse.SUPPRESS,
        help="table (default), json or yaml",
    )
    for action in common._actions:
        p._add_action(action)
    p.set_defaults(server=None, token=None, context=None, output="table")
    nouns = p.add_subparsers(dest="noun", metavar="NOUN")

    def noun(name: str, help_text: str) -> argparse._SubParsersAction[argparse.ArgumentParser]:
        sp = nouns.add_parser(name, help=help_text, parents=[common])
        return sp.add_subparsers(dest="verb", metavar="VERB", required=True)

    def verb(
        group: argparse._SubParsersAction[argparse.ArgumentParser],
        name: str,
        fn: Handler | None,
        help_text: str,
    ) -> argparse.ArgumentParser:
        vp = group.add_parser(name, help=help_text, description=help_text, parents=[common])
        vp.set_defaults(fn=fn)
        return vp

    g = noun("config", "server contexts (URL + token)")
    v = verb(g, "set-context", None, "create or update a context")
    v.add_argument("name")
    v.add_argument("--token-file")
    v.add_argument("--use", action="store_true", help="also make it current")
    verb(g, "use-context", None, "switch the current context").add_argument("name")
    verb(g, "get-contexts", None, "list contexts")

    nouns.add_parser("whoami", help="who the token is", parents=[common]).set_defaults(
        fn=whoami, verb="whoami"
    )

    g = noun("instance", "VMs")
    v = verb(g, "list", instance_list, "list instances")
    v.add_argument("--state")
    v.add_argument("--host")
    verb(g, "get", instance_get, "show one instance").add_argument("id")
    v = verb(g, "create", instance_create, "provision an instance (waits for ready)")
    v.add_argument("id")
    v.add_argument("--image")
    v.add_argument("--loadout")
    v.add_argument("--from-snapshot", help="INSTANCE/SNAPSHOT to restore from")
    v.add_argument("--network", choices=["isolated", "nat"])
    v.add_argument("--cpus", type=int)
    v.add_argument("--memory", type=int, help="MiB")
    v.add_argument("--disk", type=int, help="GiB")
    v.add_argument("--ssh-key", action="append", help="public key file (repeatable)")
    v.add_argument("--no-wait", action="store_true", help="return the operation at once")
    v.add_argument(
        "--no-build",
        action="store_true",
        help="fail instead of building the image first when it is not built yet",
    )
    for name in ("start", "stop", "restart", "force-off", "suspend", "resume"):
        verb(g, name, instance_action, f"{name} an instance").add_argument("id")
    verb(g, "delete", instance_delete, "delete an instance and its disks").add_argument("id")
    v = verb(g, "snapshot", instance_snapshot, "snapshot an instance")
    v.add_argument("id")
    v.add_argument("name")
    v.add_argument("--memory", action="store_true", help="include memory state")
    v = verb(g, "clone", instance_clone, "clone an instance from one of its snapshots")
    v.add_argument("id")
    v.add_argument("new_id")
    v.add_argument("--snapshot", required=True)
    v = verb(g, "console", instance_console, "print the serial console log")
    v.add_argument("id")
    v.add_argument("--tail", type=int, default=200, help="lines")
    v = verb(g, "exec", instance_exec, "run a command on the instance (after --), no shell")
    exec_arguments(v)
    v = verb(g, "ssh", instance_ssh, "ssh to the instance through its loopback forward")
    v.add_argument("id")
    v.add_argument("command", nargs="*")

    g = noun("session", "PTY sessions")
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

    g = noun("task", "A2A tasks (missions)")
    v = verb(g, "send", task_send, "send a task to an instance")
    v.add_argument("instance")
    v.add_argument("text")
    v = verb(g, "list", task_list, "list tasks")
    v.add_argument("--instance")
    v.add_argument("--state")
    verb(g, "get", task_get, "show a task").add_argument("id")
    verb(g, "cancel", task_cancel, "cancel a task").add_argument("id")
    verb(g, "watch", task_watch, "follow a task's output").add_argument("id")

    g = noun("image", "guest images")
    verb(g, "build", image_build, "build (or reuse) an image from a recipe").add_argument("recipe")
    verb(g, "list", image_list, "list images")

    g = noun("host", "hypervisor hosts")
    v = verb(g, "add", host_add, "add a host by libvirt URI")
    v.add_argument("name")
    v.add_argument("uri")
    v.add_argument("--label", action="append", help="KEY=VALUE (repeatable)")
    verb(g, "list", host_list, "list hosts")

    g = noun("loadout", "instance profiles")
    verb(g, "list", loadout_list, "list loadouts")
    verb(g, "show", loadout_show, "show a resolved loadout").add_argument("name")

    g = noun("secret", "write-only secrets")
    v = verb(g, "set", secret_set, "set a secret (value, '-' for stdin, or --from-file)")
    v.add_argument("name")
    v.add_argument("value", nargs="?", default="-")
    v.add_argument("--from-file")
    v.add_argument("--instance", action="append", help="bind to an instance (repeatable)")
    v.add_argument("--env", help="variable name in the instance")
    verb(g, "list", secret_list, "list secrets (never values)")
    verb(g, "delete", secret_delete, "delete a secret").add_argument("name")

    g = noun("token", "operator tokens")
    v = verb(g, "create", token_create, "create a token (printed once)")
    v.add_argument("--subject", required=True)
    v.add_argument("--role", choices=["admin", "operator", "viewer"], default="operator")
    v.add_argument("--description", default="")
    v.add_argument("--expires-in", type=int, help="seconds")
    verb(g, "list", token_list, "list tokens")
    verb(g, "revoke", token_revoke, "revoke a token").add_argument("token_id")

    g = noun("event", "the event stream")
    v = verb(g, "tail", event_tail, "print events (follow with -f)")
    v.add_argument("-f", "--follow", action="store_true")
    v.add_argument("--after", type=int, default=0)
    v.add_argument("--limit", type=int, default=100)
    v.add_argument("--type", action="append", help="type or family, e.g. instance.*")
    v.add_argument("--instance")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after `--` is a command to run (session new, instance ssh), options or not.
    trailing: list[str] | None = None
    if "--" in argv:
        cut = argv.index("--")
        argv, trailing = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(argv)
    if trailing is not None:
        if not hasattr(args, "command"):
            parser.error("`--` is only for commands (session new, instance exec, instance ssh)")
        args.command = [*(args.command or []), *trailing]
    if args.noun is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        if args.noun == "config":
            return cmd_config(args)
        target: Target = resolve_target(args.server, args.token, args.context)

        async def run() -> int | None:
            async with Api(target) as api:
                return await args.fn(api, args)

        return asyncio.run(run()) or EXIT_OK
    except CliError as exc:
        err(str(exc))
        return exc.code
    except KeyboardInterrupt:
        return 130
    except OSError as exc:
        err(str(exc))
        return 1


if __name__ == "__main__":
    sys.exit(main())
