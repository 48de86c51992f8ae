"""The provisioning pipeline: name + loadout → a running VM whose agent has enrolled.

Stages, each timed and reported as it begins: `seed` (render the NoCloud seed), `placing`,
`disk`, `defining`, `booting` (or restoring a saved state), `enrolling` (waiting for the agent),
then `ready`, or `failed` with the stage and the cause. On failure nothing is left behind: the
fleet undoes its half-made instance, this layer deletes a made one, removes its seed, and the
enroller forgets the instance's tokens.

Three sources: a cold boot from an image, a clone from a saved memory state (a snapshot with
memory), or a hand-off from the warm pool (restored and paused in advance). Clones get their new
identity from their new seed, which the in-guest agent reads when it notices it was restored.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from agentic_sandbox.fleet import (
    CloneSpec,
    EgressPolicy,
    Fleet,
    FleetError,
    Instance,
    InstanceSpec,
    InstanceState,
    KernelBoot,
    NotFound,
    Resources,
    observe_stages,
)
from agentic_sandbox.images import BuiltImage
from agentic_sandbox.provision.agent_console import AgentConsoleWatch
from agentic_sandbox.provision.bundle import AgentBundle, BundleError
from agentic_sandbox.provision.cloudinit import (
    EGRESS_LISTEN,
    AgentBootstrap,
    egress_agent_config,
    render_meta_data,
    render_network_config,
    render_user_data,
)
from agentic_sandbox.provision.loadouts import Loadout
from agentic_sandbox.provision.seed import SeedFiles, bind_to_member, write_seed_iso

log = logging.getLogger(__name__)

STAGES = ("seed", "placing", "uploading", "disk", "defining", "booting", "enrolling", "ready")
# fleet step names → pipeline stages
_FLEET_STAGE = {
    "placing": "placing",
    "uploading": "uploading",  # an image going to a host that lacks it (once per host)
    # "ports" (after the placement and any upload): a moment, counted in the stage before it
    "disk": "disk",
    "seed": "disk",  # copying the (already written) seed next to the overlay
    "defining": "defining",
    "booting": "booting",
    "restoring": "booting",
}
IDENTITY_FILE = "agentic-sandbox.json"


class ProvisionError(Exception):
    """A provision that failed: `stage` where, `cause` why (one line), `diagnostics` if any."""

    def __init__(self, stage: str, cause: str, diagnostics: str = "") -> None:
        super().__init__(f"failed at {stage}: {cause}")
        self.stage = stage
        self.cause = cause
        self.diagnostics = diagnostics
        self.stages: list[dict[str, Any]] = []  # the timings up to the failure


@dataclass(frozen=True)
class EnrollmentGrant:
    token: str
    ca_pem: str
    gateway_address: str  # the guest link gateway as the guest sees it, e.g. 10.0.2.2:8124
    server_name: str  # the TLS name the agent verifies
    agent_port: int  # the host port the guest's agent-link forward targets


class Enroller(Protocol):
    """How the pipeline gets an instance's agent enrolled (the server implements it). Every
    call names the incarnation being provisioned (an opaque id the server gives each create):
    a link of an earlier instance with the same id never counts."""

    async def grant(self, instance_id: str, incarnation: str) -> EnrollmentGrant: ...

    async def wait_ready(self, instance_id: str, incarnation: str) -> None:
        """Return when the incarnation's agent is connected (the caller bounds the wait)."""
        ...

    async def forget(self, instance_id: str, incarnation: str) -> None:
        """Revoke the incarnation's tokens and certificates (after a failed provision)."""
        ...


@dataclass
class StageRecord:
    name: str
    started: float  # time.monotonic()
    seconds: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)  # e.g. an upload's bytes so far

    def as_dict(self, origin: float) -> dict[str, Any]:
        return {
            **self.detail,
            "name": self.name,
            "at": round(self.started - origin, 3),
            "seconds": None if self.seconds is None else round(self.seconds, 3),
        }


StageListener = Callable[[str, list[StageRecord]], None]


@dataclass
class StageClock:
    """Times stages; a stage ends when the next begins."""

    listener: StageListener | None = None
    records: list[StageRecord] = field(default_factory=list)
    origin: float = field(default_factory=time.monotonic)

    @property
    def current(self) -> str | None:
        return self.records[-1].name if self.records else None

    def begin(self, name: str) -> None:
        now = time.monotonic()
        if self.records and self.records[-1].name == name:
            return
        if self.records and self.records[-1].seconds is None:
            self.records[-1].seconds = now - self.records[-1].started
        self.records.append(StageRecord(name, now))
        if self.listener is not None:
            self.listener(name, self.records)

    def detail(self, name: str, facts: dict[str, Any]) -> None:
        """Facts of the stage under way (an upload's bytes): kept on its record, told on."""
        self.begin(name)
        self.records[-1].detail.update(facts)
        if self.listener is not None:
            self.listener(name, self.records)

    def finish(self) -> None:
        if self.records and self.records[-1].seconds is None:
            self.records[-1].seconds = time.monotonic() - self.records[-1].started

    def timings(self) -> list[dict[str, Any]]:
        return [r.as_dict(self.origin) for r in self.records]


def network_refusal(loadout: Loadout, image: BuiltImage | None, egress: EgressPolicy) -> str | None:
    """Why a first boot of `image` with `loadout` cannot work on network `egress`, or None.

    What a first boot installs (the loadout's packages; the agent runtime of a cloud image
    that lacks it) comes from the network, and a restricted network (`isolated`, `allowlist`)
    has none. Known from the request alone, so callers refuse it before anything is made."""
    if not egress.restricted:
        return None
    if loadout.needs_network_at_boot:
        return (
            f"loadout {loadout.name!r} installs packages at first boot, which needs "
            f"network 'nat' (this instance is {egress.value!r})"
        )
    if image is not None and image.needs_agent_runtime:
        return (
            f"image {image.name} is a cloud image without the agent runtime; installing it "
            f"at first boot needs network 'nat' (this instance is {egress.value!r})"
        )
    return None


@dataclass(frozen=True)
class ProvisionRequest:
    instance_id: str
    owner: str
    loadout: Loadout
    source: Literal["image", "state", "pool"] = "image"
    incarnation: str = ""  # the server's id of this create (needed with an enroller)
    image: BuiltImage | None = None
    state_id: str | None = None
    pool_key: str | None = None
    vcpus: int | None = None
    memory_mib: int | None = None
    disk_gib: int | None = None
    network: EgressPolicy | None = None
    ssh_keys: tuple[str, ...] = ()
    host: str | None = None
    host_labels: dict[str, str] = field(default_factory=dict)
    ready_timeout: float = 240.0
    # While the guest's console still advances, `enrolling` may wait past `ready_timeout`, up to
    # this many seconds in all (a TCG boot on a loaded host is slow, not stuck). None: the
    # timeout is absolute (a caller who names a timeout gets exactly that).
    ready_limit: float | None = None
    start: bool = True
    wait_ready: bool = True

    @property
    def egress(self) -> EgressPolicy:
        return self.network or EgressPolicy(self.loadout.network)


@dataclass(frozen=True)
class ProvisionResult:
    instance: Instance
    stages: list[dict[str, Any]]
    seconds: float
    source: str


class Provisioner:
    def __init__(
        self,
        fleet: Fleet,
        work_dir: Path,
        *,
        agent_port: int = 8120,
        diagnose: Callable[[Instance], Any] | None = None,
    ) -> None:
        self.fleet = fleet
        self.work_dir = work_dir
        self.agent_port = agent_port
        self._diagnose = diagnose
        self.bundles = AgentBundle()
        self._bundle: bytes | None = None
        self.console_poll_seconds = 1.0  # how often `enrolling` reads the guest's console
        # past `ready_timeout`, a console silent this long ends the wait (see `ready_limit`)
        self.console_quiet_seconds = 120.0

    @property
    def seed_dir(self) -> Path:
        """Where seeds are written before the fleet copies them next to their instance (each
        is removed when its provision ends)."""
        return self.work_dir / "seeds"

    def prepare(self) -> None:
        """Make the work directories once, at start: a provision leaves none behind."""
        self.seed_dir.mkdir(parents=True, exist_ok=True)

    # ---- inputs ------------------------------------------------------------------------------
    def bundle(self) -> bytes:
        """The agent bundle of the provision under way (checked), or for a dry run's display."""
        if self._bundle is None:
            self._bundle = self.bundles.checked()
        return self._bundle

    async def check_bundle(self) -> bytes:
        """Rebuild the agent bundle from the files on disk and check that it imports (once per
        distinct content); a `ProvisionError` at stage `seed` when it does not."""
        try:
            self._bundle = await asyncio.to_thread(self.bundles.checked)
        except (BundleError, OSError) as exc:
            raise ProvisionError("seed", str(exc)) from None
        return self._bundle

    def check(self, req: ProvisionRequest) -> None:
        """Refuse requests that cannot work, before touching anything. (The server asks
        `network_refusal` itself first, so that its callers get a 422 naming `network`.)"""
        refusal = network_refusal(
            req.loadout, req.image if req.source == "image" else None, req.egress
        )
        if refusal is not None:
            raise ProvisionError("placing", refusal)
        if req.source == "image":
            if req.image is None:
                raise ProvisionError("placing", "no image given for a cold create")
        elif req.source == "state" and not req.state_id:
            raise ProvisionError("placing", "no saved state given for a clone")
        elif req.source == "pool" and not req.pool_key:
            raise ProvisionError("placing", "no pool key given")

    def seed_files(
        self,
        req: ProvisionRequest,
        grant: EnrollmentGrant | None,
        runtime_baked: bool = True,
        *,
        for_display: bool = False,
    ) -> SeedFiles:
        import json

        hostname = req.instance_id
        bootstrap = AgentBootstrap(
            instance_id=req.instance_id,
            gateway_address=grant.gateway_address if grant else f"10.0.2.2:{self.agent_port}",
            server_name=grant.server_name if grant else "agentic-sandbox-server",
            enrollment_token=grant.token if grant else "",
            ca_pem=grant.ca_pem if grant else "",
            bundle=self.bundle(),
            runtime_baked=runtime_baked,
            extra_config=(egress_agent_config() if req.egress is EgressPolicy.ALLOWLIST else {}),
        )
        identity = {
            **bootstrap.config(),
            "hostname": hostname,
            "enrollment_token": bootstrap.enrollment_token,
            "ca_pem": bootstrap.ca_pem,
            "issued_at": time.time(),
            # a restored guest reseeds its kernel's random generator with these (agent/entropy.py)
            "entropy": base64.b64encode(secrets.token_bytes(32)).decode(),
        }
        return SeedFiles(
            user_data=render_user_data(
                hostname=hostname,
                loadout=req.loadout,
                bootstrap=bootstrap,
                ssh_keys=list(req.ssh_keys),
                elide_bundle=for_display,
                nat=req.egress is EgressPolicy.NAT,
                egress_proxy=f"http://{EGRESS_LISTEN}"
                if req.egress is EgressPolicy.ALLOWLIST
                else None,
            ),
            meta_data=render_meta_data(req.instance_id, hostname),
            network_config=render_network_config("static" if req.egress.restricted else "dhcp"),
            extra={IDENTITY_FILE: json.dumps(identity, indent=2) + "\n"},
            # the same, where a restored guest's agent reads it without a mount (a hand-off)
            front=json.dumps(identity, separators=(",", ":")).encode(),
        )

    def standby_seed(self, member_id: str, ca_pem: str = "") -> Path:
        """A warm-pool member's own seed (`proto/seed_record.py`): its member id, entropy of
        its own and no token, so its agent makes the key of the instance it will become while
        it waits in the pool (`ca_pem`: the agent link's CA, for its warm-up connection).
        Written to the seed folder; whoever takes the path removes it.
        Cloud-init never reads it (the member is running, restored from its golden)."""
        import json

        identity = {
            "instance_id": member_id,
            "hostname": member_id,
            "standby": True,
            "ca_pem": ca_pem,
            "issued_at": time.time(),
            "entropy": base64.b64encode(secrets.token_bytes(32)).decode(),
        }
        files = SeedFiles(
            user_data="#cloud-config\n{}\n",
            meta_data=render_meta_data(member_id, member_id),
            extra={IDENTITY_FILE: json.dumps(identity, indent=2) + "\n"},
            front=json.dumps(identity, separators=(",", ":")).encode(),
        )
        return write_seed_iso(self.seed_dir / f"{member_id}.iso", files)

    @staticmethod
    def image_files(image: BuiltImage) -> dict[str, str]:
        """The image's files by their name in a host's image store (disk, and the kernel and
        initrd of a direct kernel boot) -> their local paths: the fleet imports them into the
        host a create is placed on when it lacks them (`InstanceSpec.image_files`)."""
        files = {f"{image.name}.qcow2": str(image.disk)}
        if image.direct_kernel_boot and image.kernel is not None:
            files[f"{image.name}.vmlinuz"] = str(image.kernel)
            if image.initrd is not None:
                files[f"{image.name}.initrd"] = str(image.initrd)
        return files

    # ---- the pipeline ------------------------------------------------------------------------
    async def provision(
        self,
        req: ProvisionRequest,
        enroller: Enroller | None,
        listener: StageListener | None = None,
    ) -> ProvisionResult:
        clock = StageClock(listener)
        started = time.monotonic()
        seed_path = self.seed_dir / f"{req.instance_id}.iso"
        made: Instance | None = None
        granted = False
        try:
            clock.begin("seed")
            self.check(req)
            if enroller is not None and not req.incarnation:
                raise ProvisionError("seed", "no incarnation given for an enrolled provision")
            await self.check_bundle()
            grant = (
                await enroller.grant(req.instance_id, req.incarnation)
                if enroller is not None
                else None
            )
            granted = grant is not None
            runtime_baked = req.image.agent_runtime_baked if req.image is not None else True
            seed = self.seed_files(req, grant, runtime_baked)
            await asyncio.to_thread(write_seed_iso, seed_path, seed)
            agent_port = grant.agent_port if grant else self.agent_port

            def on_fleet_stage(step: str) -> None:
                stage = _FLEET_STAGE.get(step)
                if stage is not None:
                    clock.begin(stage)

            uploads: dict[str, tuple[int, int]] = {}  # file -> (bytes done, its size)

            def on_fleet_detail(step: str, facts: dict[str, Any]) -> None:
                stage = _FLEET_STAGE.get(step)
                if stage is None:
                    return
                if stage == "uploading" and "image" in facts:  # the image's files, summed
                    uploads[facts["image"]] = (facts["bytes_done"], facts["bytes_total"])
                    facts = {
                        **facts,
                        "files": len(uploads),
                        "bytes_done": sum(d for d, _ in uploads.values()),
                        "bytes_total": sum(t for _, t in uploads.values()),
                    }
                clock.detail(stage, facts)

            clock.begin("placing")
            with observe_stages(on_fleet_stage, on_fleet_detail):
                made = await self._make(req, seed_path, agent_port)
            if req.start and req.wait_ready and enroller is not None:
                clock.begin("enrolling")
                await self._wait_enrolled(req, made, enroller)
            clock.begin("ready")
            clock.finish()
            return ProvisionResult(
                instance=made,
                stages=clock.timings(),
                seconds=time.monotonic() - started,
                source=req.source,
            )
        except BaseException as exc:
            stage = clock.current or "seed"
            if isinstance(exc, FleetError):
                stage = _FLEET_STAGE.get(exc.stage or "", exc.stage or stage)
            clock.finish()
            await asyncio.shield(
                self._cleanup(req.instance_id, req.incarnation, made, enroller if granted else None)
            )
            if isinstance(exc, asyncio.CancelledError):
                raise
            if isinstance(exc, ProvisionError):
                failure = exc
            elif isinstance(exc, FleetError):
                failure = ProvisionError(stage, str(exc))
            else:
                failure = ProvisionError(stage, f"{type(exc).__name__}: {exc}")
            failure.stages = clock.timings()
            if failure is exc:
                raise
            raise failure from exc
        finally:
            seed_path.unlink(missing_ok=True)

    async def _make(self, req: ProvisionRequest, seed_path: Path, agent_port: int) -> Instance:
        spec_clone = CloneSpec(
            instance_id=req.instance_id,
            owner=req.owner,
            incarnation=req.incarnation,
            loadout=req.loadout.name,
            egress=req.egress,
            agent_port=agent_port,
            seed=str(seed_path),
        )
        if req.source == "pool":
            assert req.pool_key is not None

            bound: list[str] = []

            async def bind_seed(member: str) -> bool:  # the hand-off's seed names its member
                bound.append(member)
                return await asyncio.to_thread(bind_to_member, seed_path, member)

            inst = await self.fleet.take_from_pool(req.pool_key, spec_clone, bind_seed=bind_seed)
            if inst is not None:
                return inst
            if bound:  # no member was handed over: the seed goes to a clone instead
                await self._unbind(seed_path, bound)
            status = {p.key: p for p in await self.fleet.pool_status()}.get(req.pool_key)
            if status is None:
                raise ProvisionError("placing", f"no warm pool {req.pool_key!r}")
            return await self.fleet.clone_from_state(status.state_id, spec_clone)
        if req.source == "state":
            assert req.state_id is not None
            return await self.fleet.clone_from_state(req.state_id, spec_clone)
        assert req.image is not None
        files = self.image_files(req.image)
        disk, *rest = files
        res = req.loadout.resources
        boot: KernelBoot | None = None
        if rest:
            boot = KernelBoot(
                kernel=rest[0],
                initrd=rest[1] if len(rest) > 1 else None,
                cmdline=req.image.kernel_cmdline or "console=ttyS0",
            )
        spec = InstanceSpec(
            instance_id=req.instance_id,
            owner=req.owner,
            incarnation=req.incarnation,
            image=disk,
            image_files=files,
            loadout=req.loadout.name,
            resources=Resources(
                vcpus=req.vcpus or res.cpus,
                memory_mib=req.memory_mib or res.memory_mib,
                disk_gib=req.disk_gib or res.disk_gib,
            ),
            egress=req.egress,
            agent_port=agent_port,
            seed=str(seed_path),
            host=req.host,
            host_labels=req.host_labels,
            **({"boot": boot} if boot is not None else {}),
        )
        return await self.fleet.create(spec, start=req.start)

    @staticmethod
    async def _unbind(seed_path: Path, members: list[str]) -> None:
        """Take a failed hand-off's `standby_of` off the seed. A failure is only logged: the
        clone's agent never stood by as that member, so it has no key the mark could select."""
        try:
            await asyncio.to_thread(bind_to_member, seed_path, "")
        except (OSError, ValueError) as exc:
            log.warning("unbinding the seed from %s failed: %s", ", ".join(members), exc)

    async def _wait_enrolled(
        self, req: ProvisionRequest, inst: Instance, enroller: Enroller
    ) -> None:
        """Wait for the agent to enroll while reading the guest's serial console: an agent that
        dies at start (see `agent_console`) fails the provision at once with its last words,
        instead of at the enrolment timeout. A guest whose console still advances when
        `ready_timeout` is up is booting slowly, not stuck: with a `ready_limit` the wait goes
        on until the console has been quiet for `console_quiet_seconds` or the limit is up."""
        ready = asyncio.ensure_future(enroller.wait_ready(req.instance_id, req.incarnation))
        watch = AgentConsoleWatch()
        loop = asyncio.get_running_loop()
        started = last_output = loop.time()
        limit = max(req.ready_limit or req.ready_timeout, req.ready_timeout)
        offset = 0
        try:
            while True:
                done, _ = await asyncio.wait({ready}, timeout=self.console_poll_seconds)
                if ready in done:
                    ready.result()
                    return
                now = loop.time()
                if now - started >= req.ready_timeout:
                    quiet = now - last_output
                    if now - started >= limit or quiet >= self.console_quiet_seconds:
                        raise ProvisionError(
                            "enrolling",
                            self._not_enrolled_cause(req, now - started, quiet, limit),
                            await self._why_not_enrolled(inst),
                        )
                await self._check_still_running(inst.instance_id)
                try:
                    data = await self.fleet.read_serial_log(inst.instance_id, offset)
                except FleetError as exc:  # the console is a hint; keep waiting
                    log.debug("reading %s's console: %s", inst.instance_id, exc)
                    continue
                if data:
                    last_output = loop.time()
                offset += len(data)
                crash = watch.feed(data)
                if crash is not None:
                    raise ProvisionError("enrolling", crash.cause(), await self._console_tail(inst))
        finally:
            ready.cancel()

    def _not_enrolled_cause(
        self, req: ProvisionRequest, waited: float, quiet: float, limit: float
    ) -> str:
        if limit <= req.ready_timeout:
            return f"the agent did not enroll within {req.ready_timeout:.0f}s"
        if waited >= limit:
            return (
                f"the agent did not enroll within {limit:.0f}s (the guest's console was still "
                f"advancing after {req.ready_timeout:.0f}s, so the wait went on to the limit)"
            )
        return (
            f"the agent did not enroll within {waited:.0f}s: the guest's console has been quiet "
            f"for {quiet:.0f}s"
        )

    async def _check_still_running(self, instance_id: str) -> None:
        """The VM itself went away (powered off, undefined behind the fleet's back) while its
        agent was to enroll: no point waiting for the timeout."""
        try:
            now = await self.fleet.get(instance_id)
        except NotFound:
            raise ProvisionError("enrolling", "the instance vanished while enrolling") from None
        if now.state in (InstanceState.SHUTOFF, InstanceState.LOST):
            why = f" ({now.state_reason})" if now.state_reason else ""
            raise ProvisionError(
                "enrolling", f"the VM is {now.state.value}{why} while its agent was enrolling"
            )

    async def _console_tail(self, inst: Instance) -> str:
        try:
            log_bytes = await self.fleet.read_serial_log(inst.instance_id)
        except Exception as exc:  # diagnostics must not mask the real failure
            return f"serial console unavailable: {exc}"
        return "serial console (tail):\n" + log_bytes[-4000:].decode("utf-8", "replace")

    async def _why_not_enrolled(self, inst: Instance) -> str:
        parts = [await self._console_tail(inst)]
        if self._diagnose is not None:
            try:
                parts.append(str(await self._diagnose(inst)))
            except Exception as exc:
                parts.append(f"ssh diagnosis failed: {exc}")
        return "\n".join(parts)

    async def _cleanup(
        self, instance_id: str, incarnation: str, made: Instance | None, enroller: Enroller | None
    ) -> None:
        try:
            await self.fleet.delete(instance_id)
        except Exception:
            log.exception("clean-up: deleting %s failed", instance_id)
        if enroller is not None:
            try:
                await enroller.forget(instance_id, incarnation)
            except Exception:
                log.exception("clean-up: forgetting %s's enrollment failed", instance_id)
