"""The one place where libvirt domain XML is written and read (the libvirt driver's format).

Everything is built with ``xml.etree.ElementTree`` (escaping is the library's job) from typed
values that were validated before they got here. The fleet's own facts about an instance live in
``<metadata>`` under `METADATA_NS`, so libvirt is the source of truth.
"""

from __future__ import annotations

import json
import posixpath
import uuid as uuidlib
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Any

from ..domain_config import (
    CloneIdentity,
    DomainConfig,
    KernelPaths,
    NetConfig,
    domain_config,
    instance_record,
)
from ..models import (
    AGENT_LINK_ADDRESS,
    AGENT_LINK_PORT_NAME,
    FirmwareBoot,
    FleetConfig,
    InstanceRecord,
    InstanceSpec,
    KernelBoot,
)

METADATA_NS = "urn:agentic-sandbox:fleet:1"
METADATA_PREFIX = "sbx"
QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"
NETDEV_ID = "sbxnet0"
# The user-net host alias moves off 10.0.2.2 (in `isolated` mode to an address the restricted
# guest cannot reach anyway) so 10.0.2.2 is free for the one explicit forward: the agent link.
ISOLATED_HOST_ALIAS = "10.0.2.254"
DISK_TARGET = "vda"

ET.register_namespace("qemu", QEMU_NS)
ET.register_namespace(METADATA_PREFIX, METADATA_NS)


def _sub(parent: ET.Element, tag: str, text: str | None = None, **attrib: str) -> ET.Element:
    el = ET.SubElement(parent, tag, attrib)
    if text is not None:
        el.text = text
    return el


def _qemu_opt(value: str) -> str:
    """Escape a value for QEMU's comma-separated option syntax."""
    return value.replace(",", ",,")


def netdev_value(net: NetConfig) -> str:
    """The ``-netdev user,...`` value for an instance's NIC.

    Every guest reaches the control plane the same way: one forward, 10.0.2.2:<agent port>,
    whose host side is a chardev connection to the guest link gateway (which tells the guest's
    connections apart within it; see the server's `agentlink/gateway.py`). The user-net host
    alias moves off 10.0.2.2 (to 10.0.2.254) so that address holds the forward only."""
    parts = ["user", f"id={NETDEV_ID}"]
    if net.egress.restricted:
        # restrict=on: QEMU routes nothing from the guest to the host or beyond, except the
        # explicit forwards below. The guest cannot lift this: it is QEMU's own user-net stack.
        # `allowlist` is the same here: its tools' traffic rides the agent link to the proxy.
        parts += ["restrict=on", "ipv6=off"]
    parts.append(f"host={ISOLATED_HOST_ALIAS}")
    if net.ssh_port is not None:
        parts.append(f"hostfwd=tcp:127.0.0.1:{int(net.ssh_port)}-:22")
    port = int(net.agent_port)
    host = net.control_host
    target = _qemu_opt(f"tcp:{'[' + host + ']' if ':' in host else host}:{port},reconnect=1")
    parts.append(f"guestfwd=tcp:{AGENT_LINK_ADDRESS}:{port}-{target}")
    return ",".join(parts)


def _set_link_channel_source(source: ET.Element, net: NetConfig) -> None:
    source.attrib.clear()
    source.set("mode", "connect")
    source.set("host", net.control_host)
    source.set("service", str(int(net.agent_port)))
    for child in list(source):
        source.remove(child)
    _sub(source, "reconnect", enabled="yes", timeout="1")


def link_channel(dev: ET.Element, net: NetConfig) -> None:
    """The agent link's virtio-serial port: QEMU connects it to the same guest link gateway as
    the forward (and again a second after it drops), and the guest's agent prefers it to the
    forward (no user-mode network between them; see the agent's `serial_link.py`). The guest
    sees it as /dev/virtio-ports/`AGENT_LINK_PORT_NAME`, root's alone, open once at a time."""
    ch = _sub(dev, "channel", type="tcp")
    _set_link_channel_source(_sub(ch, "source"), net)
    _sub(ch, "protocol", type="raw")
    _sub(ch, "target", type="virtio", name=AGENT_LINK_PORT_NAME)


def _link_channel_sources(root: ET.Element) -> list[ET.Element]:
    return [
        src
        for ch in root.iterfind("devices/channel")
        if (t := ch.find("target")) is not None and t.get("name") == AGENT_LINK_PORT_NAME
        if (src := ch.find("source")) is not None
    ]


def nic_device_value(pci_slot: int) -> str:
    return f"virtio-net-pci,netdev={NETDEV_ID},addr={pci_slot:#04x}"


# --------------------------------------------------------------------------- metadata


def _tag(name: str) -> str:
    return name.replace("_", "-")


def _field(tag: str) -> str:
    return tag.replace("-", "_")


def record_element(record: InstanceRecord, *, namespaced: bool = True) -> ET.Element:
    """The metadata element. Children are unqualified (what libvirt's metadata API keeps)."""
    root = ET.Element(f"{{{METADATA_NS}}}instance" if namespaced else "instance")
    root.set("version", "1")
    for key, value in record.model_dump(mode="json").items():
        if value is None:
            continue
        el = ET.SubElement(root, _tag(key))
        if isinstance(value, (list, dict)):
            el.set("json", "1")
            el.text = json.dumps(value, separators=(",", ":"))
        elif isinstance(value, bool):
            el.text = "true" if value else "false"
        else:
            el.text = str(value)
    return root


def record_metadata_xml(record: InstanceRecord) -> str:
    """For ``virDomainSetMetadata`` (which adds the namespace itself)."""
    return ET.tostring(record_element(record, namespaced=False), encoding="unicode")


def _localname(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def record_from_element(el: ET.Element) -> InstanceRecord:
    data: dict[str, Any] = {}
    for child in el:
        key = _field(_localname(child.tag))
        text = child.text or ""
        data[key] = json.loads(text) if child.get("json") == "1" else text
    return InstanceRecord.model_validate(data)


def parse_metadata_xml(xml: str) -> InstanceRecord:
    return record_from_element(ET.fromstring(xml))


def parse_record(domain_xml: str) -> InstanceRecord | None:
    """The fleet record in a domain's XML, or None for a domain the fleet does not own."""
    root = ET.fromstring(domain_xml)
    md = root.find("metadata")
    if md is None:
        return None
    el = md.find(f"{{{METADATA_NS}}}instance")
    if el is None:
        return None
    return record_from_element(el)


# --------------------------------------------------------------------------- domain


def build_domain_xml(cfg: DomainConfig) -> str:
    root = ET.Element("domain", {"type": cfg.domain_type})
    _sub(root, "name", cfg.name)
    _sub(root, "uuid", cfg.uuid)
    if cfg.title:
        _sub(root, "title", cfg.title)
    md = _sub(root, "metadata")
    md.append(record_element(cfg.record))
    _sub(root, "memory", str(cfg.memory_mib), unit="MiB")
    _sub(root, "currentMemory", str(cfg.memory_mib), unit="MiB")
    _sub(root, "vcpu", str(cfg.vcpus), placement="static")
    if cfg.cpu_shares is not None or cfg.cpu_quota_pct is not None:
        ct = _sub(root, "cputune")
        if cfg.cpu_shares is not None:
            _sub(ct, "shares", str(cfg.cpu_shares))
        if cfg.cpu_quota_pct is not None:
            period = 100000
            _sub(ct, "period", str(period))
            _sub(ct, "quota", str(period * cfg.cpu_quota_pct // 100))

    os_el = _sub(root, "os")
    if isinstance(cfg.boot, FirmwareBoot) and cfg.boot.firmware == "efi":
        os_el.set("firmware", "efi")
    _sub(os_el, "type", "hvm", arch="x86_64", machine=cfg.machine)
    if isinstance(cfg.boot, KernelPaths):
        _sub(os_el, "kernel", cfg.boot.kernel)
        if cfg.boot.initrd:
            _sub(os_el, "initrd", cfg.boot.initrd)
        _sub(os_el, "cmdline", cfg.boot.cmdline)
    else:
        _sub(os_el, "boot", dev="hd")

    feats = _sub(root, "features")
    _sub(feats, "acpi")
    _sub(feats, "apic")
    if cfg.domain_type == "qemu" and cfg.tb_cache_mib:
        tcg = _sub(feats, "tcg")
        _sub(tcg, "tb-cache", str(cfg.tb_cache_mib), unit="MiB")
    _sub(root, "clock", offset="utc")
    _sub(root, "on_poweroff", "destroy")
    _sub(root, "on_reboot", "restart")
    _sub(root, "on_crash", "destroy")

    dev = _sub(root, "devices")
    disk = _sub(dev, "disk", type="file", device="disk")
    _sub(disk, "driver", name="qemu", type="qcow2", discard="unmap")
    _sub(disk, "source", file=cfg.overlay)
    _sub(disk, "target", dev=DISK_TARGET, bus="virtio")
    if not cfg.iotune.is_empty():
        io = _sub(disk, "iotune")
        for key, value in cfg.iotune.model_dump().items():
            if value:
                _sub(io, key, str(value))

    # The seed drive is always present (empty when there is no seed) so a restored or pooled
    # guest can be handed a new one by a media change without altering the machine's ABI.
    cd = _sub(dev, "disk", type="file", device="cdrom")
    _sub(cd, "driver", name="qemu", type="raw")
    if cfg.seed:
        _sub(cd, "source", file=cfg.seed)
    _sub(
        cd,
        "target",
        dev="hdc" if cfg.machine == "pc" else "sdc",
        bus="ide" if cfg.machine == "pc" else "sata",
    )
    _sub(cd, "readonly")

    serial = _sub(dev, "serial", type="file")
    _sub(serial, "source", path=cfg.serial_log, append="on")
    _sub(serial, "target", port="0")
    rng = _sub(dev, "rng", model="virtio")
    _sub(rng, "backend", "/dev/urandom", model="random")
    _sub(dev, "memballoon", model="none")
    if cfg.domain_type != "test":
        link_channel(dev, cfg.net)
        panic = _sub(dev, "panic", model="isa")
        _sub(panic, "address", type="isa", iobase="0x505")

    cmd = ET.SubElement(root, f"{{{QEMU_NS}}}commandline")
    for value in ("-netdev", netdev_value(cfg.net), "-device", nic_device_value(cfg.nic_pci_slot)):
        ET.SubElement(cmd, f"{{{QEMU_NS}}}arg", {"value": value})
    return ET.tostring(root, encoding="unicode")


@dataclass(frozen=True)
class DomainFacts:
    """What the fleet reads back from any domain XML (its own or a saved one)."""

    name: str
    uuid: str
    domain_type: str
    overlay: str | None
    seed: str | None
    serial_log: str | None
    netdev: str | None
    memory_mib: int
    vcpus: int


def _memory_mib(root: ET.Element) -> int:
    mem = root.find("memory")
    if mem is None or not mem.text:
        return 0
    value = int(mem.text)
    unit = (mem.get("unit") or "KiB").lower()
    factor = {
        "b": 1 / 2**20,
        "bytes": 1 / 2**20,
        "k": 1 / 1024,
        "kib": 1 / 1024,
        "m": 1,
        "mib": 1,
        "g": 1024,
        "gib": 1024,
    }.get(unit, 1 / 1024)
    return int(value * factor)


def domain_facts(xml: str) -> DomainFacts:
    root = ET.fromstring(xml)
    overlay = seed = serial = netdev = None
    for disk in root.iterfind("devices/disk"):
        src = disk.find("source")
        path = src.get("file") if src is not None else None
        target = disk.find("target")
        if disk.get("device") == "cdrom":
            seed = path
        elif target is not None and target.get("dev") == DISK_TARGET:
            overlay = path
    ser = root.find("devices/serial/source")
    if ser is not None:
        serial = ser.get("path")
    args = [a.get("value") for a in root.iterfind(f"{{{QEMU_NS}}}commandline/{{{QEMU_NS}}}arg")]
    for i, a in enumerate(args[:-1]):
        if a == "-netdev":
            netdev = args[i + 1]
    vcpu = root.find("vcpu")
    return DomainFacts(
        name=root.findtext("name", ""),
        uuid=root.findtext("uuid", ""),
        domain_type=root.get("type", ""),
        overlay=overlay,
        seed=seed,
        serial_log=serial,
        netdev=netdev,
        memory_mib=_memory_mib(root),
        vcpus=int(vcpu.text) if vcpu is not None and vcpu.text else 0,
    )


def rewrite_for_clone(xml: str, ident: CloneIdentity) -> str:
    """Give a saved domain XML a new name, UUID, disk, seed, serial log, forwards and record.

    Everything that shapes the guest-visible machine (devices, addresses, CPU, memory) is kept,
    so the saved memory state still fits.
    """
    root = ET.fromstring(xml)
    root.attrib.pop("id", None)
    for tag, value in (("name", ident.name), ("uuid", ident.uuid)):
        el = root.find(tag)
        if el is None:
            el = ET.SubElement(root, tag)
        el.text = value
    for disk in root.iterfind("devices/disk"):
        target = disk.find("target")
        src = disk.find("source")
        if disk.get("device") == "cdrom":
            if src is not None:
                disk.remove(src)
            if ident.seed:
                src = ET.Element("source", {"file": ident.seed})
                disk.insert(1, src)
        elif target is not None and target.get("dev") == DISK_TARGET:
            if src is None:
                src = ET.SubElement(disk, "source")
            for k in list(src.attrib):
                if k != "file":
                    del src.attrib[k]
            src.set("file", ident.overlay)
            for child in list(src):
                src.remove(child)  # drop <seclabel> etc. of the old path
            bs = disk.find("backingStore")
            if bs is not None:
                disk.remove(bs)  # libvirt re-probes the new overlay's chain
    for tag in ("serial", "console"):
        for ch in root.iterfind(f"devices/{tag}"):
            src = ch.find("source")
            if src is not None and src.get("path"):
                src.set("path", ident.serial_log)
    for src in _link_channel_sources(root):  # a saved machine from before it has none
        _set_link_channel_source(src, ident.net)
    cmd = root.find(f"{{{QEMU_NS}}}commandline")
    if cmd is not None:
        args = list(cmd.iterfind(f"{{{QEMU_NS}}}arg"))
        for i, a in enumerate(args[:-1]):
            if a.get("value") == "-netdev":
                args[i + 1].set("value", netdev_value(ident.net))
    md = root.find("metadata")
    if md is None:
        md = ET.SubElement(root, "metadata")
    for old in md.findall(f"{{{METADATA_NS}}}instance"):
        md.remove(old)
    md.append(record_element(ident.record))
    return ET.tostring(root, encoding="unicode")


def preview_domain_xml(
    spec: InstanceSpec,
    config: FleetConfig,
    *,
    domain_type: str = "qemu",
    ssh_port: int = 42200,
    uuid: str | None = None,
) -> str:
    """The domain XML `create(spec)` would define, with the paths the local host would use —
    for dry runs; nothing is touched. Built by the same `instance_record`/`domain_config` as
    create's."""
    record = instance_record(spec, host=spec.host or "local")
    inst_dir = posixpath.join(config.data_dir, "instances")
    bases = posixpath.join(config.data_dir, "bases")
    record.overlay = posixpath.join(inst_dir, f"{record.domain}.qcow2")
    record.seed = posixpath.join(inst_dir, f"{record.domain}.seed.iso") if spec.seed else None
    record.serial_log = posixpath.join(inst_dir, f"{record.domain}.serial.log")
    record.ssh_port = ssh_port
    boot: KernelPaths | FirmwareBoot
    if isinstance(spec.boot, KernelBoot):
        boot = KernelPaths(
            posixpath.join(bases, spec.boot.kernel),
            posixpath.join(bases, spec.boot.initrd) if spec.boot.initrd else None,
            spec.boot.cmdline,
        )
    else:
        boot = spec.boot
    cfg = domain_config(
        spec,
        record,
        config=config,
        uuid=uuid or str(uuidlib.uuid4()),
        domain_type=domain_type,
        boot=boot,
        control=config.control_address,
    )
    return build_domain_xml(cfg)
