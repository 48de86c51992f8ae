"""The fleet: instances (with lifecycle, snapshots and clones), pools, images, hosts,
loadouts and agents."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Literal, TypedDict, Unpack, overload

from agentic_sandbox.sdk.errors import SandboxError
from agentic_sandbox.sdk.files import AsyncFiles
from agentic_sandbox.sdk.models import (
    Agent,
    AgentBundle,
    Console,
    Egress,
    EgressCredential,
    EgressLimits,
    EgressRule,
    EnrollmentToken,
    ExecResult,
    Host,
    HostDrain,
    HostInstance,
    Image,
    Instance,
    LibvirtdCertificate,
    Loadout,
    LoadoutActivated,
    LoadoutSaved,
    LoadoutVersion,
    LoadoutVersions,
    Operation,
    Pool,
    Snapshot,
)
from agentic_sandbox.sdk.operations import ADMIN, AsyncOperations, Progress, Resource
from agentic_sandbox.sdk.ports import PortForward, Tunnel, proxy_path
from agentic_sandbox.sdk.transport import Transport

Network = Literal["isolated", "allowlist", "nat"]
EgressNetwork = Literal["isolated", "allowlist"]
RuleLike = str | EgressRule | Mapping[str, Any]
"""A rule as `set_egress` takes it: `HOST:PORT[:METHODS]` text, an `EgressRule`, or a
mapping `{host, port, methods}`."""
Action = Literal["start", "stop", "restart", "force-off", "suspend", "resume"]
DEAD_STATES = frozenset({"crashed", "lost", "failed"})


def _rule_body(rule: RuleLike) -> str | dict[str, Any]:
    if isinstance(rule, str):
        return rule
    if isinstance(rule, EgressRule):
        return {"host": rule.host, "port": rule.port, "methods": list(rule.methods)}
    return dict(rule)


def _drop_none(body: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if v is not None}


class ExecOptions(TypedDict, total=False):
    """What `exec` and `exec_stream` take besides the argv: stdin bytes, the environment on
    top of the user's, the working directory and user, and the budget (each value lowers the
    loadout's, never past its ceiling)."""

    stdin: bytes | None
    env: Mapping[str, str] | None
    cwd: str | None
    user: str | None
    timeout_seconds: float | None
    memory_mib: int | None
    cpus: float | None
    pids: int | None
    output_bytes: int | None


BUDGET_OPTIONS = ("timeout_seconds", "memory_mib", "cpus", "pids", "output_bytes")


def _exec_body(argv: Sequence[str], opts: ExecOptions) -> dict[str, Any]:
    """The exec request of `argv` and the options (the one place both forms build it)."""
    unknown = set(opts) - set(ExecOptions.__annotations__)
    if unknown:
        raise TypeError(f"unknown exec option(s): {', '.join(sorted(unknown))}")
    env = opts.get("env")
    body: dict[str, Any] = _drop_none(
        {
            "argv": list(argv),
            "env": dict(env) if env else None,
            "cwd": opts.get("cwd"),
            "user": opts.get("user"),
        }
    )
    body["budget"] = _drop_none({name: opts.get(name) for name in BUDGET_OPTIONS})
    stdin = opts.get("stdin")
    if stdin is not None:
        body["stdin_base64"] = base64.b64encode(stdin).decode()
    return body


class AsyncInstances(Resource):
    """Instances, commands run on them over their agent link (`exec`, `exec_stream`) and
    their files (`files`: upload, download, list, stat, mkdir, remove), and their TCP ports
    (`tunnel`, `port_forward`, `proxy_url`: see `ports.py`)."""

    def __init__(self, transport: Transport, operations: AsyncOperations) -> None:
        super().__init__(transport)
        self._ops = operations
        self.files = AsyncFiles(transport)

    async def create(
        self,
        instance_id: str,
        *,
        image: str | None = None,
        loadout: str | None = None,
        loadout_version: int | None = None,
        from_snapshot: str | None = None,
        from_pool: bool | None = None,
        cpus: int | None = None,
        memory_mib: int | None = None,
        disk_gib: int | None = None,
        network: Network | None = None,
        allow: Sequence[RuleLike] | None = None,
        ssh_keys: Sequence[str] | None = None,
        host: str | None = None,
        host_labels: Mapping[str, str] | None = None,
        start: bool | None = None,
        wait_ready: bool | None = None,
        ready_timeout_seconds: float | None = None,
        loadout_spec: Mapping[str, Any] | None = None,
    ) -> Operation:
        """Start provisioning; the answer is the operation (follow it with `wait_ready`).
        `from_snapshot` is `INSTANCE/SNAPSHOT` (a memory snapshot restored under a new id).
        `allow`: the egress allowlist of an `allowlist` instance (rules as `set_egress` takes
        them; unset: the loadout's; given, `network` defaults to `allowlist`); a bad rule is a
        `ValidationFailed` naming `body.egress.allow.N`."""
        if isinstance(allow, str | bytes):
            raise TypeError("allow is a sequence of rules, not one rule")
        if allow is not None and network is None:
            network = "allowlist"
        resources = _drop_none({"cpus": cpus, "memory_mib": memory_mib, "disk_gib": disk_gib})
        body = _drop_none(
            {
                "id": instance_id,
                "image": image,
                "loadout": loadout,
                "loadout_version": loadout_version,
                "from_snapshot": from_snapshot,
                "from_pool": from_pool,
                "resources": resources or None,
                "network": network,
                "ssh_keys": list(ssh_keys) if ssh_keys is not None else None,
                "host": host,
                "host_labels": dict(host_labels) if host_labels is not None else None,
                "start": start,
                "wait_ready": wait_ready,
                "ready_timeout_seconds": ready_timeout_seconds,
                "loadout_spec": dict(loadout_spec) if loadout_spec is not None else None,
                "egress": {"allow": [_rule_body(r) for r in allow]} if allow is not None else None,
            }
        )
        return await self._t.model(Operation, "POST", f"{ADMIN}/instances", json_body=body)

    async def list(
        self,
        *,
        state: str | None = None,
        host: str | None = None,
        owner: str | None = None,
        limit: int | None = None,
    ) -> list[Instance]:
        params = {"state": state, "host": host, "owner": owner, "limit": limit}
        return await self._t.items(Instance, f"{ADMIN}/instances", params)

    async def get(self, instance_id: str) -> Instance:
        return await self._t.model(Instance, "GET", f"{ADMIN}/instances/{instance_id}")

    async def delete(self, instance_id: str) -> None:
        """Delete the instance: its domain, disks, seed, ports and record."""
        await self._t.request("DELETE", f"{ADMIN}/instances/{instance_id}")

    async def action(self, instance_id: str, action: Action, **body: Any) -> Instance:
        """A lifecycle action by name (what `start`, `stop`, … call)."""
        return await self._t.model(
            Instance, "POST", f"{ADMIN}/instances/{instance_id}/{action}", json_body=body
        )

    async def start(self, instance_id: str) -> Instance:
        return await self.action(instance_id, "start")

    async def stop(self, instance_id: str, *, grace_seconds: float | None = None) -> Instance:
        """Shut down gracefully, forcing off after the grace period."""
        return await self.action(
            instance_id, "stop", **_drop_none({"grace_seconds": grace_seconds})
        )

    async def restart(self, instance_id: str) -> Instance:
        return await self.action(instance_id, "restart")

    async def force_off(self, instance_id: str) -> Instance:
        return await self.action(instance_id, "force-off")

    async def suspend(self, instance_id: str) -> Instance:
        return await self.action(instance_id, "suspend")

    async def resume(self, instance_id: str) -> Instance:
        return await self.action(instance_id, "resume")

    async def clone(
        self,
        instance_id: str,
        new_id: str,
        *,
        snapshot: str,
        ssh_keys: Sequence[str] | None = None,
        wait_ready: bool | None = None,
    ) -> Operation:
        """A new instance from one of this instance's memory snapshots (an operation)."""
        body = _drop_none(
            {
                "new_id": new_id,
                "snapshot": snapshot,
                "ssh_keys": list(ssh_keys) if ssh_keys is not None else None,
                "wait_ready": wait_ready,
            }
        )
        return await self._t.model(
            Operation, "POST", f"{ADMIN}/instances/{instance_id}/clone", json_body=body
        )

    async def console(self, instance_id: str, *, tail: int | None = None) -> Console:
        """The serial console log's tail (`tail` lines)."""
        return await self._t.model(
            Console, "GET", f"{ADMIN}/instances/{instance_id}/console", params={"tail": tail}
        )

    async def egress(self, instance_id: str) -> Egress:
        """The instance's egress policy (isolated, allowlist or nat), its allowlist rules and
        the proxy's limits for it."""
        return await self._t.model(Egress, "GET", f"{ADMIN}/instances/{instance_id}/egress")

    async def set_egress(
        self,
        instance_id: str,
        allow: Sequence[RuleLike],
        *,
        network: EgressNetwork | None = None,
        limits: EgressLimits | Mapping[str, int] | None = None,
        credentials: Sequence[EgressCredential | Mapping[str, Any]] | None = None,
    ) -> Egress:
        """Replace the instance's allowlist with `allow` (rules as `HOST:PORT[:METHODS]` text,
        `EgressRule`s or `{host, port, methods}` mappings; empty: nothing allowed), effective
        for its next connection. `network` moves it between isolated and allowlist (unset:
        unchanged; nat cannot change while it runs, a `Conflict`); `limits` replaces the
        limits as a whole (unset: unchanged); `credentials` the brokered credentials
        (`{secret, destinations, header, format}`; unset: unchanged, empty: none). A bad rule
        is a `ValidationFailed` naming it (`body.allow.N`, or `body.allow.N.host` …)."""
        if isinstance(allow, str | bytes):
            raise TypeError("allow is a sequence of rules, not one rule")
        body: dict[str, Any] = {"allow": [_rule_body(r) for r in allow]}
        if network is not None:
            body["network"] = network
        if isinstance(limits, EgressLimits):
            body["limits"] = {
                "max_connections": limits.max_connections,
                "bandwidth_bytes_per_second": limits.bandwidth_bytes_per_second,
            }
        elif limits is not None:
            body["limits"] = dict(limits)
        if credentials is not None:
            body["credentials"] = [
                c.model_dump(include={"secret", "destinations", "header", "format"})
                if isinstance(c, EgressCredential)
                else dict(c)
                for c in credentials
            ]
        return await self._t.model(
            Egress, "PUT", f"{ADMIN}/instances/{instance_id}/egress", json_body=body
        )

    async def exec(
        self,
        instance_id: str,
        argv: Sequence[str],
        *,
        output_encoding: Literal["text", "base64"] = "text",
        **options: Unpack[ExecOptions],
    ) -> ExecResult:
        """Run `argv` (no shell unless it names one) with the `ExecOptions` (stdin, env, cwd,
        user, the budget: each value lowers the loadout's, never past its ceiling) and answer
        once it ends."""
        body = _exec_body(argv, options)
        body["output_encoding"] = output_encoding
        return await self._t.model(
            ExecResult, "POST", f"{ADMIN}/instances/{instance_id}/exec", json_body=body
        )

    async def exec_stream(
        self, instance_id: str, argv: Sequence[str], **options: Unpack[ExecOptions]
    ) -> AsyncIterator[dict[str, Any]]:
        """The command's events as they come (the same `ExecOptions` as `exec`):
        `{"type": "started", …}`, then `{"type": "stdout"|"stderr", "data": <base64>}`, then
        `{"type": "exit", …}` (the fields of `ExecResult`) — or `{"type": "error", "status",
        "code", "detail"}` when it could not finish (the link was lost, the credential
        revoked). Stopping the iteration stops the command."""
        body = _exec_body(argv, options)
        body["output_encoding"] = "base64"
        path = f"{ADMIN}/instances/{instance_id}/exec/stream"
        async for line in self._t.ndjson("POST", path, json_body=body):
            yield line

    async def tunnel(self, instance_id: str, port: int) -> Tunnel:
        """One TCP connection to 127.0.0.1:`port` inside the instance, over its agent link
        (`ApiError` with code `connection-refused` when nothing listens there)."""
        return await Tunnel.open(self._t, instance_id, port)

    async def port_forward(
        self, instance_id: str, port: int, *, local_port: int = 0
    ) -> PortForward:
        """Listen on 127.0.0.1:`local_port` (0: any free port; see `.address`) and tunnel
        every connection accepted there to `port` in the instance; `close()` ends it."""
        return await PortForward(self._t, instance_id, port).start(local_port)

    def proxy_url(self, instance_id: str, port: int, path: str = "/") -> str:
        """The reverse proxy's URL for `path` on `port` (HTTP and WebSocket; send the token
        as a bearer, or use the dashboard's cookie)."""
        return self._t.url + proxy_path(instance_id, port, path)

    async def wait_ready(
        self,
        target: Operation | str,
        *,
        timeout: float | None = None,
        progress: Progress | None = None,
    ) -> Instance:
        """Until the instance runs with its agent connected. `target` is the operation a
        create or clone returned (followed to its end first; a failure raises
        `OperationFailed` naming the stage and cause) or an instance id (its provisioning
        operation, if one is running, is followed the same way)."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        if isinstance(target, Operation):
            instance_id = target.subject_id
            await self._ops.wait(target, timeout=left(), progress=progress)
        else:
            instance_id = target
            ops = await self._ops.list(subject_id=instance_id, limit=5)
            pending = [op for op in ops if not op.done]
            if pending:
                await self._ops.wait(pending[0], timeout=left(), progress=progress)
        delay = 0.1
        while True:
            inst = await self.get(instance_id)
            if inst.ready:
                return inst
            if inst.state in DEAD_STATES:
                raise SandboxError(
                    f"instance {instance_id} is {inst.state}: {inst.state_reason or 'no reason'}"
                )
            remaining = left()
            if remaining is not None and remaining < delay:
                raise TimeoutError(
                    f"instance {instance_id} is {inst.state}, agent {inst.agent_state}, "
                    f"after {timeout}s"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 1.0)

    # ---- agents on the control host (development, tests) ------------------------------------
    async def register_host(
        self,
        instance_id: str,
        *,
        description: str = "",
        skills: Sequence[Mapping[str, Any]] | None = None,
        task_runner: Mapping[str, Any] | None = None,
        budgets: Mapping[str, Any] | None = None,
    ) -> HostInstance:
        """An instance record for an agent-client that runs on the control host, with what a
        loadout would give it: A2A `skills`, the `task_runner`, exec `budgets` (docs/a2a.md)."""
        body: dict[str, Any] = {"instance_id": instance_id, "description": description}
        if skills is not None:
            body["skills"] = [dict(s) for s in skills]
        if task_runner is not None:
            body["task_runner"] = dict(task_runner)
        if budgets is not None:
            body["budgets"] = dict(budgets)
        return await self._t.model(
            HostInstance, "POST", f"{ADMIN}/agents/host-instances", json_body=body
        )

    async def enrollment_token(
        self, instance_id: str, *, ttl_seconds: int | None = None
    ) -> EnrollmentToken:
        """A one-time token the instance's agent enrolls with (shown once)."""
        return await self._t.model(
            EnrollmentToken,
            "POST",
            f"{ADMIN}/instances/{instance_id}/enrollment-tokens",
            json_body=_drop_none({"ttl_seconds": ttl_seconds}),
        )


class AsyncSnapshots(Resource):
    async def create(
        self, instance_id: str, name: str, *, memory: bool = False, description: str = ""
    ) -> Snapshot:
        """With `memory`, the snapshot can be reverted to and cloned from."""
        body = {"name": name, "memory": memory, "description": description}
        return await self._t.model(
            Snapshot, "POST", f"{ADMIN}/instances/{instance_id}/snapshots", json_body=body
        )

    async def list(self, instance_id: str) -> list[Snapshot]:
        return await self._t.items(Snapshot, f"{ADMIN}/instances/{instance_id}/snapshots")

    async def revert(self, instance_id: str, name: str) -> Instance:
        return await self._t.model(
            Instance, "POST", f"{ADMIN}/instances/{instance_id}/snapshots/{name}/revert"
        )

    async def delete(self, instance_id: str, name: str) -> None:
        await self._t.request("DELETE", f"{ADMIN}/instances/{instance_id}/snapshots/{name}")


class AsyncPools(Resource):
    async def create(
        self,
        *,
        image: str | None = None,
        loadout: str | None = None,
        network: Network | None = None,
        size: int | None = None,
        loadout_version: int | None = None,
    ) -> Operation:
        """Prepare (or resize) the warm pool of image + loadout version (default: the active
        one) + network (an operation)."""
        body = _drop_none(
            {
                "image": image,
                "loadout": loadout,
                "loadout_version": loadout_version,
                "network": network,
                "size": size,
            }
        )
        return await self._t.model(Operation, "POST", f"{ADMIN}/pools", json_body=body)

    async def list(self) -> list[Pool]:
        return await self._t.items(Pool, f"{ADMIN}/pools")

    async def delete(self, key: str) -> None:
        """Drain and remove a pool."""
        await self._t.request("DELETE", f"{ADMIN}/pools/{key}")


class AsyncImages(Resource):
    async def build(self, recipe: str) -> Operation:
        """Build an image from a recipe (an operation; a cached build is reused at once)."""
        return await self._t.model(
            Operation, "POST", f"{ADMIN}/images", json_body={"recipe": recipe}
        )

    async def list(self) -> list[Image]:
        return await self._t.items(Image, f"{ADMIN}/images")

    async def delete(self, name: str) -> None:
        await self._t.request("DELETE", f"{ADMIN}/images/{name}")


class AsyncHosts(Resource):
    async def add(
        self,
        name: str,
        uri: str,
        *,
        labels: Mapping[str, str] | None = None,
        capacity_vcpus: int | None = None,
        capacity_memory_mib: int | None = None,
        ssh_port_range: tuple[int, int] | None = None,
        control_address: str | None = None,
        accel: str | None = None,
        data_dir: str | None = None,
        files: str | None = None,
        tls_pki_dir: str | None = None,
        ssh_key_secret: str | None = None,
        ssh_known_hosts: str | None = None,
    ) -> Host:
        """`control_address`: where this host's guests reach the server (an address its
        guest link gateway listens on); `accel` auto|kvm|tcg; `files` auto|local|remote.
        ``qemu+tls``: the server's CA gives the client certificate unless `tls_pki_dir` names
        the operator's (a directory on the server). ``qemu+ssh``: `ssh_key_secret` names your
        vault secret with the private key; `ssh_known_hosts` the host's entries (none: the
        first connection's key is recorded and checked from then on)."""
        body = _drop_none(
            {
                "name": name,
                "uri": uri,
                "labels": dict(labels or {}),
                "capacity_vcpus": capacity_vcpus,
                "capacity_memory_mib": capacity_memory_mib,
                "ssh_port_range": list(ssh_port_range) if ssh_port_range else None,
                "control_address": control_address,
                "accel": accel,
                "data_dir": data_dir,
                "files": files,
                "tls_pki_dir": tls_pki_dir,
                "ssh_key_secret": ssh_key_secret,
                "ssh_known_hosts": ssh_known_hosts,
            }
        )
        return await self._t.model(Host, "POST", f"{ADMIN}/hosts", json_body=body)

    async def libvirtd_certificate(self, csr_pem: str, names: Sequence[str]) -> LibvirtdCertificate:
        """A libvirtd's server certificate (and the CA) for a CSR made on its host, naming
        the addresses or DNS names the ``qemu+tls://`` URIs use."""
        body = {"csr_pem": csr_pem, "names": list(names)}
        return await self._t.model(
            LibvirtdCertificate, "POST", f"{ADMIN}/hosts/libvirtd-certificate", json_body=body
        )

    async def list(self) -> list[Host]:
        return await self._t.items(Host, f"{ADMIN}/hosts")

    async def get(self, name: str) -> Host:
        return await self._t.model(Host, "GET", f"{ADMIN}/hosts/{name}")

    async def drain(self, name: str) -> HostDrain:
        """No new placements on the host (what runs there keeps running); its warm pools
        move to other hosts (`HostDrain.pools` says how, or why one cannot)."""
        return await self._t.model(HostDrain, "POST", f"{ADMIN}/hosts/{name}/drain")

    async def undrain(self, name: str) -> Host:
        return await self._t.model(Host, "DELETE", f"{ADMIN}/hosts/{name}/drain")

    async def remove(self, name: str, *, force: bool = False) -> None:
        """Refused while the host has instances, unless `force`."""
        params = {"force": True} if force else None
        await self._t.request("DELETE", f"{ADMIN}/hosts/{name}", params=params)


class AsyncLoadouts(Resource):
    """Loadouts as versioned records: each save of a name is an immutable, content-addressed
    version (saving identical content again returns that version); one version per name is
    active, moved by `activate` with the version the caller expects to be active."""

    async def list(self) -> list[Loadout]:
        """Every loadout the caller sees, at its active version."""
        return await self._t.items(Loadout, f"{ADMIN}/loadouts")

    @overload
    async def get(self, name: str) -> Loadout: ...
    @overload
    async def get(self, name: str, version: int) -> LoadoutVersion: ...
    async def get(self, name: str, version: int | None = None) -> Loadout | LoadoutVersion:
        """The active version of `name`, resolved (`extends` applied); with `version`, that
        version as it was saved (`LoadoutVersion`)."""
        if version is not None:
            return await self._t.model(
                LoadoutVersion, "GET", f"{ADMIN}/loadouts/{name}/versions/{int(version)}"
            )
        return await self._t.model(Loadout, "GET", f"{ADMIN}/loadouts/{name}")

    async def apply(
        self, spec: Mapping[str, Any], *, name: str | None = None, shared: bool = False
    ) -> LoadoutSaved:
        """Save `spec` (a loadout as its YAML would be) as a version of `name` (default: the
        spec's own `name`); `created` says whether this save made the version. `shared`:
        admins only, on a name's first save."""
        chosen = name if name is not None else spec.get("name")
        if not isinstance(chosen, str):
            raise ValueError("a loadout needs a name (the spec's `name`, or name=)")
        body: dict[str, Any] = {"name": chosen, "spec": dict(spec)}
        if shared:
            body["shared"] = True
        return await self._t.model(LoadoutSaved, "POST", f"{ADMIN}/loadouts", json_body=body)

    async def versions(self, name: str) -> LoadoutVersions:
        """Every version of `name`, oldest first, and which is active."""
        return await self._t.model(LoadoutVersions, "GET", f"{ADMIN}/loadouts/{name}/versions")

    async def activate(self, name: str, version: int, *, expected_version: int) -> LoadoutActivated:
        """Make `version` active if `expected_version` still is (else `Conflict`, HTTP 409)."""
        body = {"version": version, "expected_version": expected_version}
        return await self._t.model(
            LoadoutActivated, "POST", f"{ADMIN}/loadouts/{name}/activate", json_body=body
        )


class AsyncAgents(Resource):
    async def bundles(self) -> list[AgentBundle]:
        """The bundles a rollout can send: the server's own first, then the uploaded ones."""
        return await self._t.items(AgentBundle, f"{ADMIN}/agent-bundles")

    async def list(self) -> list[Agent]:
        return await self._t.items(Agent, f"{ADMIN}/agents")

    async def get(self, instance_id: str) -> Agent:
        return await self._t.model(Agent, "GET", f"{ADMIN}/agents/{instance_id}")

    async def upload_bundle(self, data: bytes) -> AgentBundle:
        """Upload an agent bundle (a gzipped tar as the server builds it, with its MANIFEST);
        the same bytes again answer the bundle kept before. Admins only."""
        return await self._t.model(
            AgentBundle,
            "POST",
            f"{ADMIN}/agent-bundles",
            data=data,
            content_type="application/gzip",
        )

    async def rollout(
        self,
        *,
        bundle: str | None = None,
        instances: Sequence[str] | None = None,
        trial_seconds: int | None = None,
    ) -> Operation:
        """Roll `bundle` (a digest; default: the server's own agent) out to `instances` (default:
        every connected agent), one at a time (an operation: follow it with
        `operations.wait`; its result lists each instance's outcome). Admins only."""
        body = _drop_none(
            {
                "bundle": bundle,
                "instances": list(instances) if instances is not None else None,
                "trial_seconds": trial_seconds,
            }
        )
        return await self._t.model(Operation, "POST", f"{ADMIN}/agent-rollouts", json_body=body)
