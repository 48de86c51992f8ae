"""`provision/provision-vm.sh` (also `python -m agentic_sandbox.provision`, or the `provision-vm`
console script): provision one VM from a shell.

With a running server (found at --server / $SANDBOX_URL, or the local one with a readable admin
token) it asks the server, so the agent enrolls there. Without one it drives libvirt directly
through the same pipeline (the server adopts such instances when it starts: the fleet keeps its
facts in the domain's metadata).

Exit status: 0 done, 1 failed (the message names the stage and the cause; nothing is left
behind), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Literal

from agentic_sandbox.fleet import (
    EgressPolicy,
    Fleet,
    FleetConfig,
    HostSpec,
    InstanceSpec,
    KernelBoot,
    Resources,
    preview_domain_xml,
)
from agentic_sandbox.images import ImageBuilder, ImageNotFound, ImageStore
from agentic_sandbox.provision.egress_rules import Rule, RuleError, parse_rule
from agentic_sandbox.provision.loadouts import LoadoutCatalog, LoadoutError, load_catalog
from agentic_sandbox.provision.pipeline import Provisioner, ProvisionError, ProvisionRequest

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
DEFAULT_URL = "http://127.0.0.1:8122"
PROG = "provision-vm.sh"


class UsageError(Exception):
    pass


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Provision one agentic-sandbox VM: overlay disk, cloud-init seed, libvirt "
        "domain, and (with a server) the agent's enrollment.",
        epilog="Exit status: 0 done, 1 failed (nothing left behind), 2 bad arguments.",
    )
    p.add_argument("name", help="instance id: [a-z0-9][a-z0-9-]{0,62}")
    p.add_argument("--loadout", default="minimal", help="loadout name, or a YAML file")
    p.add_argument("--image", help="image name or recipe (default debian-12-agent)")
    p.add_argument("--cpus", type=int, help="vCPUs (default: the loadout's)")
    p.add_argument("--memory", type=int, metavar="MiB", help="memory (default: the loadout's)")
    p.add_argument("--disk", type=int, metavar="GiB", help="disk size (default: the loadout's)")
    p.add_argument(
        "--ssh-key",
        action="append",
        default=[],
        metavar="FILE",
        help="public key for the agent user (repeatable)",
    )
    p.add_argument(
        "--network",
        choices=["isolated", "allowlist", "nat"],
        help="egress policy (allowlist: only --allow destinations, through the server's proxy)",
    )
    p.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="an allowlist rule: HOST:PORT, *.SUFFIX:PORT, [V6]:PORT, optionally :GET,HEAD "
        "(repeatable; with --network allowlist)",
    )
    p.add_argument("--start", action="store_true", help="start the VM (default: define only)")
    p.add_argument(
        "--wait",
        action="store_true",
        help="start and wait until it is ready (agent enrolled; without a server: cloud-init done)",
    )
    p.add_argument(
        "--from-snapshot",
        metavar="INSTANCE/SNAPSHOT",
        help="restore a memory snapshot under this new identity",
    )
    p.add_argument(
        "--delete",
        action="store_true",
        help="delete the instance NAME (domain, disks, seed, port) instead",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait (default 300)")
    p.add_argument(
        "--dry-run", action="store_true", help="print the domain XML and user-data; change nothing"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--server", help=f"server URL (default $SANDBOX_URL, or {DEFAULT_URL} if up)")
    p.add_argument(
        "--token", help="operator token (default $SANDBOX_TOKEN or the admin token file)"
    )
    p.add_argument("--no-server", action="store_true", help="never use a server")
    p.add_argument(
        "--data-dir",
        type=Path,
        default=Path(os.environ.get("SANDBOX_DATA_DIR", "/var/lib/agentic-sandbox")),
        help="data directory shared with the server (default /var/lib/agentic-sandbox)",
    )
    p.add_argument(
        "--images-dir",
        type=Path,
        default=None,
        help="image cache (default $SANDBOX_IMAGES_DIR, else DATA_DIR/images)",
    )
    p.add_argument(
        "--libvirt-uri", default=os.environ.get("SANDBOX_LIBVIRT_URI") or "qemu:///system"
    )
    return p


def validate(args: argparse.Namespace) -> None:
    if not NAME_RE.match(args.name):
        raise UsageError(f"NAME {args.name!r} must match [a-z0-9][a-z0-9-]{{0,62}}")
    for flag, value, lo, hi in (
        ("--cpus", args.cpus, 1, 64),
        ("--memory", args.memory, 256, 262144),
        ("--disk", args.disk, 2, 4096),
    ):
        if value is not None and not lo <= value <= hi:
            raise UsageError(f"{flag} must be between {lo} and {hi}")
    for key in args.ssh_key:
        if not Path(key).is_file():
            raise UsageError(f"--ssh-key {key}: no such file")
    if args.from_snapshot and not re.match(
        r"^[a-z0-9][a-z0-9-]{0,62}/[a-z0-9][a-z0-9_.-]{0,62}$", args.from_snapshot
    ):
        raise UsageError("--from-snapshot must be INSTANCE/SNAPSHOT")
    if args.timeout <= 0:
        raise UsageError("--timeout must be positive")
    allow_rules(args)
    args.data_dir = args.data_dir.resolve()
    env_images = os.environ.get("SANDBOX_IMAGES_DIR")
    args.images_dir = (
        args.images_dir or (Path(env_images) if env_images else None) or args.data_dir / "images"
    ).resolve()
    if args.wait:
        args.start = True


def say(args: argparse.Namespace, message: str) -> None:
    if not args.json:
        print(message, file=sys.stderr, flush=True)


def read_keys(paths: list[str]) -> tuple[str, ...]:
    keys = []
    for p in paths:
        text = Path(p).read_text().strip()
        if not text.startswith(("ssh-", "ecdsa-", "sk-")):
            raise UsageError(f"--ssh-key {p}: not an OpenSSH public key")
        keys.append(text)
    return tuple(keys)


def load_loadout(spec: str) -> tuple[LoadoutCatalog, str]:
    catalog = load_catalog()
    path = Path(spec)
    if spec.endswith((".yaml", ".yml")) or path.is_file():
        if not path.is_file():
            raise UsageError(f"--loadout {spec}: no such file")
        try:
            name = catalog.add_yaml(path.read_text(), where=str(path))
        except LoadoutError as exc:
            raise UsageError(f"--loadout: {exc}") from None
        return catalog, name
    if spec not in catalog.names():
        raise UsageError(f"--loadout {spec!r}: unknown (known: {', '.join(catalog.names())})")
    return catalog, spec


# ---- server mode -----------------------------------------------------------------------------
def find_server(args: argparse.Namespace) -> tuple[str, str] | None:
    if args.no_server:
        return None
    url = args.server or os.environ.get("SANDBOX_URL")
    token = args.token or os.environ.get("SANDBOX_TOKEN")
    explicit = url is not None
    url = (url or DEFAULT_URL).rstrip("/")
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=2) as resp:
            if resp.status != 200:
                raise OSError("not healthy")
    except (OSError, urllib.error.URLError) as exc:
        if explicit:
            raise UsageError(f"no server answers at {url}: {exc}") from None
        return None
    if token is None:
        token_file = args.data_dir / "admin-token"
        try:
            token = token_file.read_text().strip()
        except OSError:
            if explicit:
                raise UsageError(f"a server runs at {url} but no token was given") from None
            return None
    return url, token


def http(url: str, token: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url + path,
        data=data,
        method=method,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, {"detail": raw.decode(errors="replace")}


def allow_rules(args: argparse.Namespace) -> list[Rule]:
    """The --allow rules, checked (a bad one exits with the reason)."""
    if args.allow and args.network not in (None, "allowlist"):
        raise UsageError(f"--allow needs --network allowlist, not {args.network}")
    rules = []
    for text in args.allow:
        try:
            rules.append(parse_rule(text))
        except RuleError as exc:
            raise UsageError(f"--allow {text!r}: {exc}") from None
    return rules


def via_server(args: argparse.Namespace, url: str, token: str) -> dict[str, Any]:
    catalog, loadout_name = load_loadout(args.loadout)
    body: dict[str, Any] = {"id": args.name, "wait_ready": args.wait, "start": args.start}
    if args.loadout.endswith((".yaml", ".yml")) or Path(args.loadout).is_file():
        body["loadout_spec"] = catalog.raw(loadout_name)
    else:
        body["loadout"] = loadout_name
    if args.image:
        body["image"] = args.image
    if args.from_snapshot:
        body["from_snapshot"] = args.from_snapshot
    if args.network:
        body["network"] = args.network
    if args.allow:
        body["egress"] = {"allow": [r.text for r in allow_rules(args)]}
    res = {
        k: v
        for k, v in (("cpus", args.cpus), ("memory_mib", args.memory), ("disk_gib", args.disk))
        if v is not None
    }
    if res:
        body["resources"] = res
    if args.ssh_key:
        body["ssh_keys"] = list(read_keys(args.ssh_key))
    say(args, f"using the server at {url}")
    status, op = http(url, token, "POST", "/api/v2/admin/instances", body)
    if status != 202:
        detail = (op or {}).get("detail", f"HTTP {status}")
        if status in (400, 409, 422):
            raise UsageError(detail)
        raise ProvisionError("request", detail)
    shown: set[str] = set()
    deadline = time.monotonic() + args.timeout + 30
    while op["state"] not in ("succeeded", "failed", "canceled"):
        for st in op.get("stages") or []:
            if st["name"] not in shown:
                shown.add(st["name"])
                say(args, f"  stage {st['name']}")
        if time.monotonic() > deadline:
            raise ProvisionError(op.get("stage") or "waiting", "timed out waiting for the server")
        time.sleep(0.5)
        status, op = http(url, token, "GET", f"/api/v2/admin/operations/{op['id']}")
    if op["state"] != "succeeded":
        err = op.get("error") or {}
        raise ProvisionError(err.get("stage", "unknown"), err.get("cause", op["state"]))
    _, inst = http(url, token, "GET", f"/api/v2/admin/instances/{args.name}")
    return {
        "instance": inst,
        "stages": op.get("stages"),
        "server": url,
        "seconds": (op.get("result") or {}).get("seconds"),
    }


# ---- direct mode -----------------------------------------------------------------------------
def image_for(args: argparse.Namespace, dry: bool) -> Any:
    store = ImageStore(args.images_dir)
    name = args.image or "debian-12-agent"
    try:
        return store.get(name)
    except ImageNotFound:
        pass
    builder = ImageBuilder(args.images_dir, require_root=not dry)
    try:
        cached = builder.cached(name)
    except Exception as exc:
        raise UsageError(f"--image {name!r}: not an image or a recipe ({exc})") from None
    if cached is not None or dry:
        return cached
    say(args, f"building image {name} (once; later runs reuse it)")

    def progress(p: Any) -> None:
        say(args, f"  image {p.stage} {p.fraction * 100:3.0f}%")

    return builder.build(name, progress=progress)


def direct(args: argparse.Namespace) -> dict[str, Any]:
    catalog, loadout_name = load_loadout(args.loadout)
    loadout = catalog.resolve(loadout_name)
    keys = read_keys(args.ssh_key)
    network = EgressPolicy(args.network or loadout.network)
    allow_rules(args)
    if network is EgressPolicy.ALLOWLIST:
        raise UsageError(
            "--network allowlist needs the server (its egress proxy enforces the list); "
            "use --server (or $SANDBOX_URL) with a token, or --network isolated or nat"
        )
    source: Literal["image", "state"] = "state" if args.from_snapshot else "image"
    state_id = None
    if args.from_snapshot:
        inst_id, snap = args.from_snapshot.split("/", 1)
        state_id = f"{inst_id}--{snap}"[:63].rstrip("-.")
    image = None if args.from_snapshot else image_for(args, args.dry_run)
    req = ProvisionRequest(
        instance_id=args.name,
        owner=os.environ.get("USER", "root"),
        loadout=loadout,
        source=source,
        image=image,
        state_id=state_id,
        vcpus=args.cpus,
        memory_mib=args.memory,
        disk_gib=args.disk,
        network=network,
        ssh_keys=keys,
        start=args.start,
        wait_ready=False,
    )
    config = FleetConfig(
        data_dir=str(args.data_dir / "fleet"),
        default_uri=args.libvirt_uri,
    )
    if args.dry_run:
        return dry_run(args, req, config)
    return asyncio.run(run_direct(args, req, config))


def dry_run(args: argparse.Namespace, req: ProvisionRequest, config: FleetConfig) -> dict[str, Any]:
    prov = Provisioner(Fleet(config), args.data_dir / "provision")
    if req.image is not None:
        prov.check(req)
    else:
        say(
            args,
            f"(image {args.image or 'debian-12-agent'} is not built yet; names are placeholders)",
        )
    seed = prov.seed_files(req, None, for_display=True)
    image = req.image
    res = req.loadout.resources
    boot = None
    if image is not None and image.direct_kernel_boot:
        boot = KernelBoot(
            kernel=f"{image.name}.vmlinuz",
            initrd=f"{image.name}.initrd" if image.initrd else None,
            cmdline=image.kernel_cmdline or "console=ttyS0",
        )
    spec = InstanceSpec(
        instance_id=req.instance_id,
        owner=req.owner,
        image=f"{image.name}.qcow2" if image is not None else "debian-12-agent.qcow2",
        loadout=req.loadout.name,
        resources=Resources(
            vcpus=req.vcpus or res.cpus,
            memory_mib=req.memory_mib or res.memory_mib,
            disk_gib=req.disk_gib or res.disk_gib,
        ),
        egress=req.egress,
        seed=str(args.data_dir / "provision" / "seeds" / f"{req.instance_id}.iso"),
        **({"boot": boot} if boot is not None else {}),
    )
    from xml.dom import minidom

    xml = minidom.parseString(preview_domain_xml(spec, config)).toprettyxml(indent="  ")
    return {
        "dry_run": True,
        "domain_xml": xml,
        "user_data": seed.user_data,
        "meta_data": seed.meta_data,
        "network_config": seed.network_config,
    }


async def run_direct(
    args: argparse.Namespace, req: ProvisionRequest, config: FleetConfig
) -> dict[str, Any]:
    async with Fleet(config) as fleet:
        await fleet.open([HostSpec(name="local", uri=args.libvirt_uri)])
        prov = Provisioner(fleet, args.data_dir / "provision")

        def on_stage(name: str, _records: Any) -> None:
            say(args, f"  stage {name}")

        result = await prov.provision(req, None, on_stage)
        if args.wait:
            say(args, "  waiting for cloud-init to finish (no server: the agent cannot enroll)")
            deadline = time.monotonic() + args.timeout
            while True:
                log_bytes = await fleet.read_serial_log(req.instance_id)
                if b"agentic-sandbox: stage cloud-init-done" in log_bytes:
                    break
                if time.monotonic() > deadline:
                    await fleet.delete(req.instance_id)
                    raise ProvisionError(
                        "booting", f"cloud-init did not finish in {args.timeout:.0f}s"
                    )
                await asyncio.sleep(1)
        inst = await fleet.get(req.instance_id)
        return {
            "instance": {
                "id": inst.instance_id,
                "state": inst.state.value,
                "host": inst.host,
                "ssh_port": inst.record.ssh_port,
                "network_policy": inst.record.egress.value,
            },
            "stages": result.stages,
            "seconds": round(result.seconds, 3),
            "server": None,
        }


def delete(args: argparse.Namespace, server: tuple[str, str] | None) -> dict[str, Any]:
    if server is not None:
        url, token = server
        status, body = http(url, token, "DELETE", f"/api/v2/admin/instances/{args.name}")
        if status not in (204, 404):
            raise ProvisionError("deleting", (body or {}).get("detail", f"HTTP {status}"))
        return {"deleted": args.name, "server": url}

    async def run() -> None:
        config = FleetConfig(data_dir=str(args.data_dir / "fleet"), default_uri=args.libvirt_uri)
        async with Fleet(config) as fleet:
            await fleet.open([HostSpec(name="local", uri=args.libvirt_uri)])
            await fleet.delete(args.name)

    asyncio.run(run())
    return {"deleted": args.name, "server": None}


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        validate(args)
        server = None if args.dry_run else find_server(args)
        if args.delete:
            result = delete(args, server)
        else:
            result = via_server(args, *server) if server else direct(args)
    except UsageError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except ProvisionError as exc:
        if args.json:
            print(json.dumps({"error": {"stage": exc.stage, "cause": exc.cause}}))
        print(f"{PROG}: failed at {exc.stage}: {exc.cause}", file=sys.stderr)
        if exc.diagnostics and not args.json:
            print(exc.diagnostics[-3000:], file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if args.json:
        print(json.dumps(result, indent=2))
    elif "deleted" in result:
        print(f"{result['deleted']}: deleted")
    elif result.get("dry_run"):
        print("# domain XML\n" + result["domain_xml"])
        print("# user-data\n" + result["user_data"])
    else:
        inst = result["instance"]
        print(
            f"{inst['id']}: {inst['state']} on {inst.get('host')} "
            f"(ssh: ssh -p {inst.get('ssh_port')} agent@127.0.0.1)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
