"""A new domain, fully resolved: the one place an `InstanceSpec` becomes a `DomainConfig`.

`create` and the dry-run preview (`preview_domain_xml`, used by ``provision-vm.sh --dry-run``)
both go through `instance_record` and `domain_config`, so what a dry run shows is what create
defines. A driver renders a `DomainConfig` in its own terms (libvirt: domain XML).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .models import (
    DOMAIN_PREFIX,
    EgressPolicy,
    FirmwareBoot,
    FleetConfig,
    HostSpec,
    InstanceRecord,
    InstanceSpec,
    IoTune,
)


@dataclass(frozen=True)
class KernelPaths:
    kernel: str
    initrd: str | None
    cmdline: str


@dataclass(frozen=True)
class NetConfig:
    egress: EgressPolicy
    agent_port: int  # the guest link gateway's port (guest side 10.0.2.2:<it>, host side too)
    ssh_port: int | None
    control_host: str = "127.0.0.1"  # where the gateway listens, as this host reaches it


@dataclass(frozen=True)
class DomainConfig:
    """A fully resolved domain: every path is a path on the target host."""

    name: str
    uuid: str
    domain_type: str  # qemu (TCG), kvm, or test (libvirt's test driver)
    vcpus: int
    memory_mib: int
    overlay: str
    serial_log: str
    net: NetConfig
    record: InstanceRecord
    boot: KernelPaths | FirmwareBoot = field(default_factory=FirmwareBoot)
    seed: str | None = None
    machine: str = "pc"
    nic_pci_slot: int = 0x1F
    cpu_shares: int | None = None
    cpu_quota_pct: int | None = None
    iotune: IoTune = field(default_factory=IoTune)
    tb_cache_mib: int | None = None
    title: str = ""


@dataclass(frozen=True)
class CloneIdentity:
    """What a clone (or a captured state) changes in a definition it starts from."""

    name: str
    uuid: str
    overlay: str
    serial_log: str
    seed: str | None
    net: NetConfig
    record: InstanceRecord


def domain_name_for(instance_id: str) -> str:
    return f"{DOMAIN_PREFIX}{instance_id}"


def instance_record(spec: InstanceSpec, *, host: str) -> InstanceRecord:
    """The record of a new instance, before its host's paths and port are known."""
    return InstanceRecord(
        instance_id=spec.instance_id,
        domain=domain_name_for(spec.instance_id),
        host=host,
        owner=spec.owner,
        incarnation=spec.incarnation,
        image=spec.image,
        loadout=spec.loadout,
        egress=spec.egress,
        agent_port=spec.agent_port,
        vcpus=spec.resources.vcpus,
        memory_mib=spec.resources.memory_mib,
        anti_affinity=spec.anti_affinity,
        restart_on_crash=spec.restart_on_crash,
    )


def control_address(host: HostSpec, config: FleetConfig) -> str:
    """Where guests on ``host`` reach the control plane: the host's own address, else the
    fleet's."""
    return host.control_address or config.control_address


def net_config(
    egress: EgressPolicy, agent_port: int, ssh_port: int | None, control: str
) -> NetConfig:
    return NetConfig(egress, agent_port, ssh_port, control)


def domain_config(
    spec: InstanceSpec,
    record: InstanceRecord,
    *,
    config: FleetConfig,
    uuid: str,
    domain_type: str,
    boot: KernelPaths | FirmwareBoot,
    control: str,
) -> DomainConfig:
    """The domain of ``spec`` once ``record`` has its host's paths and SSH port; ``control``
    is where its guest reaches the control plane (`control_address`)."""
    res = spec.resources
    return DomainConfig(
        name=record.domain,
        uuid=uuid,
        domain_type=domain_type,
        vcpus=res.vcpus,
        memory_mib=res.memory_mib,
        overlay=record.overlay,
        serial_log=record.serial_log,
        seed=record.seed,
        record=record,
        boot=boot,
        net=net_config(spec.egress, spec.agent_port, record.ssh_port, control),
        machine=config.machine,
        nic_pci_slot=config.nic_pci_slot,
        cpu_shares=res.cpu_shares,
        cpu_quota_pct=res.cpu_quota_pct,
        iotune=res.iotune,
        tb_cache_mib=res.tb_cache_mib,
        title=f"agentic-sandbox instance {spec.instance_id}",
    )
