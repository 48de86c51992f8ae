"""Verbs of the fleet: instance, operation, pool, image, host, loadout."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from agentic_sandbox.sandboxctl.exec import add_arguments as exec_arguments
from agentic_sandbox.sandboxctl.exec import instance_exec
from agentic_sandbox.sandboxctl.exits import EXIT_AUTH, EXIT_INVALID, EXIT_OK, EXIT_USAGE, CliError
from agentic_sandbox.sandboxctl.files import (
    add_ls,
    add_pull,
    add_push,
    instance_ls,
    instance_pull,
    instance_push,
)
from agentic_sandbox.sandboxctl.output import doc, emit, err, progress
from agentic_sandbox.sandboxctl.parsing import Nouns, kv, wait_options
from agentic_sandbox.sandboxctl.ports import add_arguments as port_forward_arguments
from agentic_sandbox.sandboxctl.ports import instance_port_forward
from agentic_sandbox.sdk import (
    ApiError,
    AsyncClient,
    Egress,
    Forbidden,
    Operation,
    OperationFailed,
    Unauthorized,
    ValidationFailed,
)

INSTANCE_COLS = ["id", "state", "agent_state", "host", "loadout", "vcpus", "memory_mib", "owner"]
OPERATION_COLS = ["id", "kind", "subject_id", "state", "stage", "progress", "created_at"]
SNAPSHOT_COLS = ["name", "kind", "state", "created_at"]
POOL_COLS = ["key", "image", "loadout", "network", "size", "ready", "last_error"]
LOADOUT_VERSION_COLS = ["version", "active", "digest", "extends", "created_by", "created_at"]


# ---- operations --------------------------------------------------------------------------------
def _table_view(op: dict[str, Any]) -> dict[str, Any]:
    """An operation for a table: long diagnostics become a pointer to the full output."""
    error = op.get("error")
    if not isinstance(error, dict) or not error.get("diagnostics"):
        return op
    lines = str(error["diagnostics"]).count("\n") + 1
    brief = {**error, "diagnostics": f"{lines} lines (shown with -o yaml or -o json)"}
    return {**op, "error": brief}


def emit_operation(op: Operation, fmt: str) -> None:
    emit(_table_view(op.to_dict()) if fmt == "table" else op.to_dict(), fmt)


async def follow_operation(
    c: AsyncClient, op: Operation, fmt: str, *, wait: bool = True, show: bool = True
) -> int:
    """Without `wait`, print the operation as it is. Else follow it to its end with a
    progress line on stderr, then print it; a failed or canceled one also prints its stage
    and cause on stderr and exits non-zero."""
    if not wait:
        emit_operation(op, fmt)
        return EXIT_OK
    with progress(f"{op.kind} {op.subject_id}") as update:

        def on_progress(now: Operation) -> None:
            update(now.stage or now.state, float(now.progress or 0.0))

        op = await c.operations.wait(op, progress=on_progress, check=False)
        if op.state == "succeeded":
            update("done", 1.0)
    if show or op.state != "succeeded":
        emit_operation(op, fmt)
    if op.state != "succeeded":
        raise CliError(str(OperationFailed(op)))
    return EXIT_OK


async def operation_list(c: AsyncClient, a: argparse.Namespace) -> None:
    ops = await c.operations.list(subject_id=a.subject, state=a.state, limit=a.limit)
    emit(doc(ops), a.output, OPERATION_COLS)


async def operation_get(c: AsyncClient, a: argparse.Namespace) -> int:
    return await follow_operation(c, await c.operations.get(a.id), a.output, wait=a.wait)


async def operation_cancel(c: AsyncClient, a: argparse.Namespace) -> int:
    op = await c.operations.cancel(a.id)
    if not a.wait:
        emit_operation(op, a.output)
        return EXIT_OK
    op = await c.operations.wait(op, check=False)
    emit_operation(op, a.output)
    return EXIT_OK


# ---- instances ---------------------------------------------------------------------------------
async def instance_list(c: AsyncClient, a: argparse.Namespace) -> None:
    emit(doc(await c.instances.list(state=a.state, host=a.host)), a.output, INSTANCE_COLS)


async def instance_get(c: AsyncClient, a: argparse.Namespace) -> None:
    emit(doc(await c.instances.get(a.id)), a.output)


async def instance_create(c: AsyncClient, a: argparse.Namespace) -> int:
    if a.allow is not None and a.network not in (None, "allowlist"):
        raise CliError(
            f"--allow is the allowlist of --network allowlist, not {a.network}", EXIT_USAGE
        )
    spec: dict[str, Any] = {
        "image": a.image,
        "loadout": a.loadout,
        "loadout_version": a.loadout_version,
        "from_snapshot": a.from_snapshot,
        "from_pool": a.from_pool,
        "network": a.network,
        "allow": a.allow,
        "cpus": a.cpus,
        "memory_mib": a.memory,
        "disk_gib": a.disk,
    }
    if a.ssh_key:
        spec["ssh_keys"] = [Path(p).expanduser().read_text().strip() for p in a.ssh_key]
    try:
        op = await c.instances.create(a.id, **spec)
    except ApiError as exc:
        if (
            a.allow
            and isinstance(exc, ValidationFailed)
            and any(f.startswith("body.egress.allow.") for f in exc.fields)
        ):
            raise _bad_rules(exc, a.allow, "body.egress.allow") from None
        recipe = exc.problem.get("recipe") if exc.code == "image-not-built" else None
        if recipe is None or a.no_build:
            raise
        await build_first(c, str(recipe), exc)
        op = await c.instances.create(a.id, **spec)
    return await follow_operation(c, op, a.output, wait=a.wait)


async def build_first(c: AsyncClient, recipe: str, refusal: ApiError) -> None:
    """A create on a server that has not built its image yet: build it (what `image build`
    does, with the same progress line), then the create goes on."""
    print(
        f"image {recipe} is not built yet: building it first (`sandboxctl image build {recipe}`;"
        " ~90 s the first time, cached after)",
        file=sys.stderr,
    )
    try:
        op = await c.images.build(recipe)
    except (Unauthorized, Forbidden):
        raise CliError(
            f"{refusal}\nbuilding an image needs the admin role: ask an admin to run "
            f"`sandboxctl image build {recipe}`",
            EXIT_AUTH,
        ) from None
    await follow_operation(c, op, "table", show=False)
    print(f"image {recipe} is built", file=sys.stderr)


async def instance_action(c: AsyncClient, a: argparse.Namespace) -> None:
    body = {"grace_seconds": a.grace} if getattr(a, "grace", None) is not None else {}
    emit(doc(await c.instances.action(a.id, a.verb, **body)), a.output)


async def instance_delete(c: AsyncClient, a: argparse.Namespace) -> None:
    await c.instances.delete(a.id)
    print(f"deleted {a.id}")


async def instance_snapshot(c: AsyncClient, a: argparse.Namespace) -> None:
    emit(doc(await c.snapshots.create(a.id, a.name, memory=a.memory)), a.output)


async def instance_snapshots(c: AsyncClient, a: argparse.Namespace) -> None:
    emit(doc(await c.snapshots.list(a.id)), a.output, SNAPSHOT_COLS)


async def instance_revert(c: AsyncClient, a: argparse.Namespace) -> None:
    emit(doc(await c.snapshots.revert(a.id, a.snapshot)), a.output)


async def instance_clone(c: AsyncClient, a: argparse.Namespace) -> int:
    op = await c.instances.clone(a.id, a.new_id, snapshot=a.snapshot)
    return await follow_operation(c, op, a.output, wait=a.wait)


async def instance_console(c: AsyncClient, a: argparse.Namespace) -> None:
    sys.stdout.write((await c.instances.console(a.id, tail=a.tail)).text)


def _egress_view(policy: Egress) -> dict[str, Any]:
    """The policy for a table: its fields, the rules as rows (text form first), the limits."""
    return {
        "instance_id": policy.instance_id,
        "incarnation": policy.incarnation,
        "network": policy.network,
        "allow": [
            {
                "rule": r.text,
                "host": r.host,
                "port": r.port,
                "methods": ", ".join(r.methods) or "any",
            }
            for r in policy.allow
        ]
        or "nothing",
        "limits": {
            "max_connections": policy.limits.max_connections,
            "bandwidth_bytes_per_second": policy.limits.bandwidth_bytes_per_second or "no limit",
        },
        "credentials": [
            {
                "secret": cred.secret,
                "destinations": ", ".join(cred.destinations),
                "header": cred.header,
                "format": cred.format,
            }
            for cred in policy.credentials
        ]
        or "none",
    }


CREDENTIAL_FORM = "SECRET=HOST:PORT[,HOST:PORT…][,header=NAME][,format=TEXT]"


def parse_credential(text: str) -> dict[str, Any]:
    """`--credential SECRET=HOST:PORT[,HOST:PORT…][,header=NAME][,format=TEXT]` as the API's
    `{secret, destinations, header, format}` (`format=` last: it takes the rest, commas and
    all). The server validates the parts; this only splits them."""
    secret, sep, rest = text.partition("=")
    if not sep or not secret or not rest:
        raise CliError(f"--credential {text!r}: expected {CREDENTIAL_FORM}", EXIT_USAGE)
    out: dict[str, Any] = {"secret": secret, "destinations": []}
    head, fmt_sep, fmt = rest.partition(",format=")
    if rest.startswith("format="):
        head, fmt_sep, fmt = "", "=", rest.removeprefix("format=")
    if fmt_sep:
        out["format"] = fmt
    for part in filter(None, head.split(",")):
        if part.startswith("header="):
            out["header"] = part.removeprefix("header=")
        else:
            out["destinations"].append(part)
    if not out["destinations"]:
        raise CliError(
            f"--credential {text!r}: no HOST:PORT (expected {CREDENTIAL_FORM})", EXIT_USAGE
        )
    return out


def _bad_rules(
    exc: ValidationFailed,
    given: list[str],
    at: str = "body.allow",
    credentials: list[str] | None = None,
) -> CliError:
    """The server's refusal of a rule (at `at`.N) or a credential (`body.credentials.N`), with
    the `--allow` or `--credential` it came from named."""
    lines, named = [], 0
    sources = [(at.split("."), "--allow", given)]
    if credentials is not None:
        sources.append((["body", "credentials"], "--credential", credentials))
    for field, message in exc.fields.items():
        parts = field.split(".")
        for prefix, flag, texts in sources:
            n = len(prefix)
            if len(parts) > n and parts[:n] == prefix and parts[n].isdigit():
                index = int(parts[n])
                if index < len(texts):
                    lines.append(f"{flag} {texts[index]!r} ({field}): {message}")
                    named += 1
                    break
        else:
            lines.append(f"{field}: {message}")
    if not lines or named < len(lines):  # something besides the rules: the server's words too
        return CliError(str(exc), EXIT_INVALID, exc.problem)
    return CliError("\n".join(lines), EXIT_INVALID, exc.problem)


async def instance_egress(c: AsyncClient, a: argparse.Namespace) -> None:
    limit_given = a.max_connections is not None or a.bandwidth is not None
    creds_given = a.credential is not None or a.clear_credentials
    changing = a.allow is not None or a.clear or a.network is not None or limit_given
    if a.credential and a.clear_credentials:
        raise CliError("--clear-credentials and --credential are each other's opposite", EXIT_USAGE)
    credentials = [parse_credential(t) for t in a.credential or []] if creds_given else None
    if not changing and not creds_given:
        policy = await c.instances.egress(a.id)
    elif not changing:  # the credentials only: the rules stay as they are
        rules = [r.text for r in (await c.instances.egress(a.id)).allow]
        try:
            policy = await c.instances.set_egress(a.id, rules, credentials=credentials)
        except ValidationFailed as exc:
            raise _bad_rules(exc, [], credentials=list(a.credential or [])) from None
    else:
        if a.allow is None and not a.clear:
            raise CliError(
                "a change replaces the allowlist: give its rules with --allow HOST:PORT "
                "(repeatable), or --clear for none",
                EXIT_USAGE,
            )
        if a.allow and a.clear:
            raise CliError("--clear and --allow are each other's opposite", EXIT_USAGE)
        limits = None
        if limit_given:  # the API replaces the limits whole: keep the one not given
            current = (await c.instances.egress(a.id)).limits
            limits = {
                "max_connections": (
                    current.max_connections if a.max_connections is None else a.max_connections
                ),
                "bandwidth_bytes_per_second": (
                    current.bandwidth_bytes_per_second if a.bandwidth is None else a.bandwidth
                ),
            }
        given = list(a.allow or [])
        try:
            policy = await c.instances.set_egress(
                a.id, given, network=a.network, limits=limits, credentials=credentials
            )
        except ValidationFailed as exc:
            raise _bad_rules(exc, given, credentials=list(a.credential or [])) from None
    emit(_egress_view(policy) if a.output == "table" else doc(policy), a.output)


async def instance_ssh(c: AsyncClient, a: argparse.Namespace) -> int:
    port = (await c.instances.get(a.id)).ssh_port
    if not port:
        raise CliError(f"instance {a.id} has no SSH forward")
    argv = ["ssh", "-p", str(port), "-o", "StrictHostKeyChecking=accept-new", "agent@127.0.0.1"]
    os.execvp("ssh", [*argv, *a.command])
    return EXIT_OK  # not reached


# ---- pools, images, hosts, loadouts ------------------------------------------------------------
async def pool_create(c: AsyncClient, a: argparse.Namespace) -> int:
    op = await c.pools.create(
        image=a.image,
        loadout=a.loadout,
        loadout_version=a.loadout_version,
        network=a.network,
        size=a.size,
    )
    return await follow_operation(c, op, a.output, wait=a.wait)


async def pool_list(c: AsyncClient, a: argparse.Namespace) -> None:
    pools = doc(await c.pools.list())
    if a.output == "table":  # a pool is of one loadout version: NAME@VERSION
        for p in pools["items"]:
            if p.get("loadout_version") is not None:
                p["loadout"] = f"{p['loadout']}@{p['loadout_version']}"
    emit(pools, a.output, POOL_COLS)


async def pool_delete(c: AsyncClient, a: argparse.Namespace) -> None:
    await c.pools.delete(a.key)
    print(f"deleted pool {a.key}")


async def image_build(c: AsyncClient, a: argparse.Namespace) -> int:
    return await follow_operation(c, await c.images.build(a.recipe), a.output, wait=a.wait)


async def image_list(c: AsyncClient, a: argparse.Namespace) -> None:
    emit(
        doc(await c.images.list()), a.output, ["name", "kind", "state", "size_bytes", "created_at"]
    )


async def host_add(c: AsyncClient, a: argparse.Namespace) -> None:
    host = await c.hosts.add(
        a.name,
        a.uri,
        labels=kv(a.label or [], "--label"),
        control_address=a.control_address,
        accel=a.accel,
        data_dir=a.data_dir,
        files=a.files,
        tls_pki_dir=a.tls_pki_dir,
        ssh_key_secret=a.ssh_key_secret,
        ssh_known_hosts=_read_text(a.ssh_known_hosts) if a.ssh_known_hosts else None,
    )
    emit(doc(host), a.output)


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {path}: {exc}", EXIT_INVALID) from None


async def host_libvirtd_cert(c: AsyncClient, a: argparse.Namespace) -> None:
    """On the libvirtd host: a key made here (serverkey.pem, 0600, never sent), the server's
    CA signs its CSR (servercert.pem), and the CA (cacert.pem) — libvirtd's TLS files."""
    out = Path(a.out)
    key_path = out / "serverkey.pem"
    if key_path.exists() and not a.force:
        raise CliError(f"{key_path} exists (--force to make a new key)", EXIT_INVALID)
    key_pem, csr_pem = libvirtd_key_and_csr()
    got = await c.hosts.libvirtd_certificate(csr_pem, a.names)
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_pem)
    os.chmod(key_path, 0o600)
    (out / "servercert.pem").write_text(got.servercert_pem)
    (out / "cacert.pem").write_text(got.cacert_pem)
    err(
        f"wrote {key_path} (0600), {out / 'servercert.pem'} and {out / 'cacert.pem'}: point "
        "libvirtd.conf's key_file, cert_file and ca_file at them and set listen_tls = 1"
    )


def libvirtd_key_and_csr() -> tuple[bytes, str]:
    """A fresh EC P-256 key (PEM) and its certificate request (the CA sets the names)."""
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .sign(key, hashes.SHA256())
        .public_bytes(serialization.Encoding.PEM)
        .decode()
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return key_pem, csr


async def host_drain(c: AsyncClient, a: argparse.Namespace) -> None:
    host = await c.hosts.drain(a.name)
    emit(doc(host), a.output)
    for pool in host.pools:  # what the drain does with the host's warm pools, said plainly
        if pool.state == "moving":
            err(f"warm pool {pool.key}: moving to another host (operation {pool.operation_id})")
        else:
            err(f"warm pool {pool.key}: stays on {a.name}: {pool.reason}")


async def host_undrain(c: AsyncClient, a: argparse.Namespace) -> None:
    emit(doc(await c.hosts.undrain(a.name)), a.output)


async def host_list(c: AsyncClient, a: argparse.Namespace) -> None:
    emit(
        doc(await c.hosts.list()),
        a.output,
        [
            "name",
            "uri",
            "control_address",
            "state",
            "draining",
            "labels",
            "committed_vcpus",
            "cpus",
            "committed_memory_mib",
            "memory_mib",
            "instances",
        ],
    )


async def loadout_list(c: AsyncClient, a: argparse.Namespace) -> None:
    emit(
        doc(await c.loadouts.list()),
        a.output,
        ["name", "version", "owner", "description", "network"],
    )


async def loadout_show(c: AsyncClient, a: argparse.Namespace) -> None:
    emit(doc(await c.loadouts.get(a.name)), a.output if a.output != "table" else "yaml")


def _read_loadout_file(path: str) -> dict[str, Any]:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {path}: {exc}", EXIT_INVALID) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise CliError(f"{path}: not valid YAML: {exc}", EXIT_INVALID) from None
    if not isinstance(data, dict):
        raise CliError(f"{path}: a loadout is a mapping", EXIT_INVALID)
    return data


def _version_row(v: dict[str, Any]) -> dict[str, Any]:
    ext = v.get("extends")
    return {
        **v,
        "digest": str(v.get("digest", ""))[:12],
        "extends": f"{ext['name']}@{ext['version']}" if isinstance(ext, dict) else "",
    }


async def loadout_apply(c: AsyncClient, a: argparse.Namespace) -> None:
    spec = _read_loadout_file(a.file)
    name = a.name or spec.get("name")
    if not isinstance(name, str):
        raise CliError(f"{a.file}: the loadout has no name (give one with --name)", EXIT_INVALID)
    saved = await c.loadouts.apply(spec, name=name, shared=a.shared)
    what = "saved as" if saved.created else "unchanged: identical content is"
    err(f"loadout {saved.name}: {what} version {saved.version}")
    if a.output == "table":
        emit(_version_row(doc(saved)), a.output, [*LOADOUT_VERSION_COLS, "created"])
    else:
        emit(doc(saved), a.output)


async def loadout_versions(c: AsyncClient, a: argparse.Namespace) -> None:
    versions = doc(await c.loadouts.versions(a.name))
    if a.output == "table":
        rows = {"items": [_version_row(v) for v in versions["items"]]}
        emit(rows, a.output, LOADOUT_VERSION_COLS)
    else:
        emit(versions, a.output)


async def loadout_activate(c: AsyncClient, a: argparse.Namespace) -> None:
    expected = a.expected_version
    if expected is None:  # the version active now; still a compare-and-set against a race
        expected = (await c.loadouts.get(a.name)).version
    emit(doc(await c.loadouts.activate(a.name, a.version, expected_version=expected)), a.output)


# ---- the parser --------------------------------------------------------------------------------
def register(nouns: Nouns) -> None:
    verb = nouns.verb
    g = nouns.noun("instance", "VMs")
    v = verb(g, "list", instance_list, "list instances")
    v.add_argument("--state")
    v.add_argument("--host")
    verb(g, "get", instance_get, "show one instance").add_argument("id")
    v = verb(g, "create", instance_create, "provision an instance (waits for ready)")
    v.add_argument("id")
    v.add_argument("--image")
    v.add_argument("--loadout")
    v.add_argument("--loadout-version", type=int, help="a version of the loadout (default: active)")
    v.add_argument("--from-snapshot", help="INSTANCE/SNAPSHOT to restore from")
    pool = v.add_mutually_exclusive_group()
    pool.add_argument(
        "--from-pool",
        dest="from_pool",
        action="store_const",
        const=True,
        help="take a VM from the matching warm pool (an error when there is none); default: "
        "the matching pool when there is one, else a cold boot",
    )
    pool.add_argument(
        "--cold",
        dest="from_pool",
        action="store_const",
        const=False,
        help="boot from the image even when a matching warm pool is ready",
    )
    v.add_argument("--network", choices=["isolated", "allowlist", "nat"])
    v.add_argument(
        "--allow",
        action="append",
        metavar="HOST:PORT[:METHODS]",
        help="a rule of the instance's egress allowlist (repeatable; implies --network allowlist)",
    )
    v.add_argument("--cpus", type=int)
    v.add_argument("--memory", type=int, help="MiB")
    v.add_argument("--disk", type=int, help="GiB")
    v.add_argument("--ssh-key", action="append", help="public key file (repeatable)")
    wait_options(v, "the provisioning")
    v.add_argument(
        "--no-build",
        action="store_true",
        help="fail instead of building the image first when it is not built yet",
    )
    for name in ("start", "stop", "restart", "force-off", "suspend", "resume"):
        v = verb(g, name, instance_action, f"{name} an instance")
        v.add_argument("id")
        if name == "stop":
            v.add_argument("--grace", type=float, help="seconds before forcing off")
    verb(g, "delete", instance_delete, "delete an instance and its disks").add_argument("id")
    v = verb(g, "snapshot", instance_snapshot, "snapshot an instance")
    v.add_argument("id")
    v.add_argument("name")
    v.add_argument("--memory", action="store_true", help="include memory state")
    verb(g, "snapshots", instance_snapshots, "list an instance's snapshots").add_argument("id")
    v = verb(g, "revert", instance_revert, "revert an instance to one of its snapshots")
    v.add_argument("id")
    v.add_argument("snapshot")
    v = verb(g, "clone", instance_clone, "clone an instance from one of its snapshots")
    v.add_argument("id")
    v.add_argument("new_id")
    v.add_argument("--snapshot", required=True)
    wait_options(v, "the clone")
    v = verb(g, "console", instance_console, "print the serial console log")
    v.add_argument("id")
    v.add_argument("--tail", type=int, default=200, help="lines")
    v = verb(
        g,
        "egress",
        instance_egress,
        "show the instance's egress policy, or replace its allowlist (--allow, --clear)",
    )
    v.add_argument("id")
    v.add_argument(
        "--allow",
        action="append",
        metavar="HOST:PORT[:METHODS]",
        help="a rule of the new allowlist (repeatable; it replaces all the rules)",
    )
    v.add_argument("--clear", action="store_true", help="replace the allowlist with no rules")
    v.add_argument(
        "--network", choices=["isolated", "allowlist"], help="move between these (nat is fixed)"
    )
    v.add_argument("--max-connections", type=int, help="connections at once (with a change)")
    v.add_argument(
        "--bandwidth", type=int, help="bytes per second each way, 0 for no limit (with a change)"
    )
    v.add_argument(
        "--credential",
        action="append",
        metavar=CREDENTIAL_FORM,
        help="a brokered credential: the proxy sets header NAME (default Authorization) to "
        "TEXT (default 'Bearer {value}', {value} the secret's) on TLS requests to those "
        "destinations (repeatable; replaces all the credentials; alone it keeps the rules)",
    )
    v.add_argument(
        "--clear-credentials", action="store_true", help="remove every brokered credential"
    )
    v = verb(g, "exec", instance_exec, "run a command on the instance (after --), no shell")
    exec_arguments(v)
    add_push(verb(g, "push", instance_push, "upload a file or a directory into the instance"))
    add_pull(verb(g, "pull", instance_pull, "download a file or a directory from the instance"))
    add_ls(verb(g, "ls", instance_ls, "list a directory in the instance"))
    port_forward_arguments(
        verb(
            g,
            "port-forward",
            instance_port_forward,
            "forward 127.0.0.1:LOCAL to a port in the instance (over its agent link)",
        )
    )
    v = verb(g, "ssh", instance_ssh, "ssh to the instance through its loopback forward")
    v.add_argument("id")
    v.add_argument("command", nargs="*")

    g = nouns.noun("operation", "long-running work: provisioning, clones, image builds, pools")
    v = verb(g, "list", operation_list, "list operations, newest first")
    v.add_argument("--subject", help="instance, image or pool the operation is about")
    v.add_argument("--state", choices=["running", "succeeded", "failed", "canceled"])
    v.add_argument("--limit", type=int, default=100)
    v = verb(g, "get", operation_get, "show an operation (--wait follows it to its end)")
    v.add_argument("id")
    v.add_argument("--wait", action="store_true", help="follow it to its end with progress")
    v = verb(g, "cancel", operation_cancel, "cancel a running operation")
    v.add_argument("id")
    v.add_argument("--wait", action="store_true", help="wait until it has stopped")

    g = nouns.noun("pool", "warm pools: paused VMs ready to hand out")
    v = verb(g, "create", pool_create, "prepare (or resize) a pool for image + loadout + network")
    v.add_argument("--image")
    v.add_argument("--loadout")
    v.add_argument("--loadout-version", type=int, help="a version of the loadout (default: active)")
    v.add_argument("--network", choices=["isolated", "nat"])
    v.add_argument("--size", type=int)
    wait_options(v, "the preparation")
    verb(g, "list", pool_list, "list pools and how many VMs each has ready")
    verb(g, "delete", pool_delete, "drain and remove a pool").add_argument("key")

    g = nouns.noun("image", "guest images")
    v = verb(g, "build", image_build, "build (or reuse) an image from a recipe")
    v.add_argument("recipe")
    wait_options(v, "the build")
    verb(g, "list", image_list, "list images")

    g = nouns.noun("host", "hypervisor hosts")
    v = verb(g, "add", host_add, "add a host by libvirt URI")
    v.add_argument("name")
    v.add_argument("uri")
    v.add_argument("--label", action="append", help="KEY=VALUE (repeatable)")
    v.add_argument(
        "--control-address", help="where this host's guests reach the server (an IP address)"
    )
    v.add_argument("--accel", choices=["auto", "kvm", "tcg"])
    v.add_argument("--data-dir", help="the host's directory for bases, instances, states")
    v.add_argument("--files", choices=["auto", "local", "remote"])
    v.add_argument(
        "--tls-pki-dir",
        help="qemu+tls: the operator's cacert.pem/clientcert.pem/clientkey.pem directory on the "
        "server (default: a client certificate from the server's CA)",
    )
    v.add_argument(
        "--ssh-key-secret", help="qemu+ssh: the name of your vault secret with the private key"
    )
    v.add_argument(
        "--ssh-known-hosts",
        metavar="FILE",
        help="qemu+ssh: the host's known_hosts entries (default: recorded on first connection)",
    )
    v = verb(
        g,
        "libvirtd-cert",
        host_libvirtd_cert,
        "on a libvirtd host: make its TLS key here and get its certificate from the server's CA",
    )
    v.add_argument("names", nargs="+", help="the addresses/DNS names qemu+tls:// URIs use")
    v.add_argument("--out", default="/etc/pki/libvirt-sandbox", help="where to write the files")
    v.add_argument("--force", action="store_true", help="replace an existing serverkey.pem")
    verb(g, "list", host_list, "list hosts")
    verb(g, "drain", host_drain, "no new placements on a host").add_argument("name")
    verb(g, "undrain", host_undrain, "a drained host takes placements again").add_argument("name")

    g = nouns.noun("loadout", "instance profiles")
    verb(g, "list", loadout_list, "list loadouts")
    verb(g, "show", loadout_show, "show a resolved loadout").add_argument("name")
    v = verb(g, "apply", loadout_apply, "save a loadout file as a version (identical: unchanged)")
    v.add_argument("file", help="a loadout YAML file (- for stdin)")
    v.add_argument("--name", help="the loadout's name (default: the file's `name`)")
    v.add_argument("--shared", action="store_true", help="admins: everyone may read it")
    verb(g, "versions", loadout_versions, "list a loadout's versions").add_argument("name")
    v = verb(g, "activate", loadout_activate, "make a version of a loadout the active one")
    v.add_argument("name")
    v.add_argument("version", type=int)
    v.add_argument(
        "--expected-version",
        type=int,
        help="the version you expect active now (default: the one active now); 409 if moved",
    )
