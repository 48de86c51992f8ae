"""Domain XML: every option, parsed back; escaping; metadata round trip; clone rewrite."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from agentic_sandbox.fleet.domain_config import CloneIdentity, DomainConfig, KernelPaths, NetConfig
from agentic_sandbox.fleet.libvirt.domain_xml import (
    METADATA_NS,
    QEMU_NS,
    build_domain_xml,
    domain_facts,
    netdev_value,
    parse_metadata_xml,
    parse_record,
    record_metadata_xml,
    rewrite_for_clone,
)
from agentic_sandbox.fleet.models import EgressPolicy, FirmwareBoot, InstanceRecord, IoTune

NASTY = 'o\'wn<er>&"x"'


def record(**kw: object) -> InstanceRecord:
    base: dict[str, object] = dict(
        instance_id="dev-1",
        domain="sbx-dev-1",
        host="h1",
        owner=NASTY,
        image="img",
        overlay="/d/instances/sbx-dev-1.qcow2",
        serial_log="/d/instances/sbx-dev-1.serial.log",
        ssh_port=42222,
        agent_port=8120,
        vcpus=2,
        memory_mib=768,
        loadout="py<3>",
        created_at="2024-05-01T12:00:00Z",
    )
    base.update(kw)
    return InstanceRecord.model_validate(base)


def config(**kw: object) -> DomainConfig:
    base: dict[str, object] = dict(
        name="sbx-dev-1",
        uuid="6f1f7f3a-3c8e-4f1e-9a43-0d4c6d1b7a10",
        domain_type="qemu",
        vcpus=2,
        memory_mib=768,
        overlay="/d/instances/sbx-dev-1.qcow2",
        serial_log="/d/instances/sbx-dev-1.serial.log",
        net=NetConfig(EgressPolicy.ISOLATED, 8120, 42222),
        record=record(),
    )
    base.update(kw)
    return DomainConfig(**base)  # type: ignore[arg-type]


def parse(cfg: DomainConfig) -> ET.Element:
    return ET.fromstring(build_domain_xml(cfg))


def qemu_args(root: ET.Element) -> list[str]:
    return [a.get("value", "") for a in root.iter(f"{{{QEMU_NS}}}arg")]


def test_basics_resources_and_devices() -> None:
    root = parse(
        config(
            cpu_shares=512,
            cpu_quota_pct=150,
            tb_cache_mib=64,
            iotune=IoTune(read_bytes_sec=1000, write_iops_sec=50),
        )
    )
    assert root.get("type") == "qemu"
    assert root.findtext("name") == "sbx-dev-1"
    assert root.findtext("uuid") == "6f1f7f3a-3c8e-4f1e-9a43-0d4c6d1b7a10"
    assert root.find("memory").text == "768" and root.find("memory").get("unit") == "MiB"
    assert root.findtext("vcpu") == "2"
    assert root.findtext("cputune/shares") == "512"
    assert root.findtext("cputune/period") == "100000"
    assert root.findtext("cputune/quota") == "150000"
    tb = root.find("features/tcg/tb-cache")
    assert tb is not None and tb.text == "64" and tb.get("unit") == "MiB"
    disk = root.find("devices/disk[@device='disk']")
    assert disk.find("source").get("file") == "/d/instances/sbx-dev-1.qcow2"
    assert disk.find("driver").get("type") == "qcow2"
    assert disk.find("target").get("bus") == "virtio"
    assert disk.findtext("iotune/read_bytes_sec") == "1000"
    assert disk.findtext("iotune/write_iops_sec") == "50"
    assert disk.find("iotune/total_bytes_sec") is None
    cd = root.find("devices/disk[@device='cdrom']")
    assert cd.find("readonly") is not None and cd.find("source") is None  # empty seed drive
    serial = root.find("devices/serial/source")
    assert serial.get("append") == "on" and serial.get("path").endswith(".serial.log")
    assert root.find("devices/rng[@model='virtio']/backend").text == "/dev/urandom"
    assert root.find("devices/panic") is not None
    assert root.find("devices/interface") is None  # networking only via qemu:commandline


def test_no_tuning_elements_when_unset_and_no_tcg_for_kvm() -> None:
    root = parse(config(domain_type="kvm", tb_cache_mib=64))
    assert root.find("cputune") is None
    assert root.find("features/tcg") is None
    assert root.find("devices/disk/iotune") is None


def test_kernel_boot_and_firmware_boot() -> None:
    root = parse(config(boot=KernelPaths("/b/vmlinuz", "/b/initrd", "console=ttyS0 a=<b>")))
    assert root.findtext("os/kernel") == "/b/vmlinuz"
    assert root.findtext("os/initrd") == "/b/initrd"
    assert root.findtext("os/cmdline") == "console=ttyS0 a=<b>"
    assert root.find("os/boot") is None
    bios = parse(config(boot=FirmwareBoot()))
    assert bios.find("os/kernel") is None and bios.find("os/boot").get("dev") == "hd"
    efi = parse(config(boot=FirmwareBoot(firmware="efi")))
    assert efi.find("os").get("firmware") == "efi"


def test_seed_present() -> None:
    root = parse(config(seed="/d/instances/sbx-dev-1.seed.iso"))
    cd = root.find("devices/disk[@device='cdrom']")
    assert cd.find("source").get("file") == "/d/instances/sbx-dev-1.seed.iso"


def test_isolated_network() -> None:
    root = parse(config())
    args = qemu_args(root)
    assert args[0] == "-netdev" and args[2] == "-device"
    netdev = args[1]
    assert netdev.startswith("user,id=sbxnet0,")
    assert "restrict=on" in netdev
    assert "hostfwd=tcp:127.0.0.1:42222-:22" in netdev
    # the only way out: the agent link, forwarded by QEMU to host loopback
    assert "guestfwd=tcp:10.0.2.2:8120-tcp:127.0.0.1:8120,,reconnect=1" in netdev
    assert "host=10.0.2.254" in netdev
    assert args[3] == "virtio-net-pci,netdev=sbxnet0,addr=0x1f"


def test_nat_network_and_every_forward_on_loopback() -> None:
    netdev = netdev_value(NetConfig(EgressPolicy.NAT, 9000, 42001))
    assert "restrict" not in netdev
    assert netdev == (
        "user,id=sbxnet0,host=10.0.2.254,hostfwd=tcp:127.0.0.1:42001-:22,"
        "guestfwd=tcp:10.0.2.2:9000-tcp:127.0.0.1:9000,,reconnect=1"
    )
    for value in (netdev, netdev_value(NetConfig(EgressPolicy.ISOLATED, 1, 2))):
        for part in value.split(","):
            if part.startswith("hostfwd="):
                assert part.startswith("hostfwd=tcp:127.0.0.1:")


def test_escaping_and_metadata_round_trip() -> None:
    xml = build_domain_xml(config())
    assert NASTY not in xml  # escaped by the XML library
    rec = parse_record(xml)
    assert rec is not None
    assert rec.owner == NASTY and rec.loadout == "py<3>"
    assert rec == record()
    assert ET.fromstring(xml).find(f"metadata/{{{METADATA_NS}}}instance") is not None


def test_metadata_api_form_round_trip() -> None:
    rec = record(crashes=[{"at": "2024-01-01T00:00:00Z", "reason": "x"}], pool="k")
    xml = record_metadata_xml(rec)
    assert not xml.startswith("<sbx:")  # libvirt adds the namespace itself
    assert parse_metadata_xml(xml) == rec


def test_foreign_domain_has_no_record() -> None:
    assert parse_record("<domain type='qemu'><name>x</name></domain>") is None
    assert parse_record("<domain><metadata><other xmlns='urn:x'/></metadata></domain>") is None


def test_facts() -> None:
    f = domain_facts(build_domain_xml(config(seed="/s.iso")))
    assert (f.name, f.overlay, f.seed, f.memory_mib, f.vcpus) == (
        "sbx-dev-1",
        "/d/instances/sbx-dev-1.qcow2",
        "/s.iso",
        768,
        2,
    )
    assert f.netdev is not None and "restrict=on" in f.netdev


def test_rewrite_for_clone_changes_identity_keeps_machine() -> None:
    src = build_domain_xml(config(seed="/old.iso", boot=KernelPaths("/k", None, "c")))
    new_rec = record(instance_id="clone-1", domain="sbx-clone-1", owner="bob")
    out = rewrite_for_clone(
        src,
        CloneIdentity(
            name="sbx-clone-1",
            uuid="11111111-2222-3333-4444-555555555555",
            overlay="/d/instances/sbx-clone-1.qcow2",
            serial_log="/d/instances/c.log",
            seed=None,
            net=NetConfig(EgressPolicy.NAT, 8120, 42300),
            record=new_rec,
        ),
    )
    a, b = ET.fromstring(src), ET.fromstring(out)
    assert b.findtext("name") == "sbx-clone-1"
    assert b.findtext("uuid") == "11111111-2222-3333-4444-555555555555"
    f = domain_facts(out)
    assert f.overlay == "/d/instances/sbx-clone-1.qcow2" and f.seed is None
    assert f.serial_log == "/d/instances/c.log"
    assert f.netdev == netdev_value(NetConfig(EgressPolicy.NAT, 8120, 42300))
    assert "hostfwd=tcp:127.0.0.1:42300-:22" in f.netdev
    assert parse_record(out) == new_rec
    # the machine itself is unchanged
    for path in ("memory", "vcpu", "os/kernel", "os/cmdline"):
        assert a.findtext(path) == b.findtext(path)
    assert len(a.findall("devices/*")) == len(b.findall("devices/*"))
    assert qemu_args(a)[3] == qemu_args(b)[3]


@pytest.mark.parametrize("machine,bus", [("pc", "ide"), ("q35", "sata")])
def test_seed_drive_bus_follows_machine(machine: str, bus: str) -> None:
    root = parse(config(machine=machine))
    assert root.find("os/type").get("machine") == machine
    assert root.find("devices/disk[@device='cdrom']/target").get("bus") == bus


def test_every_guest_reaches_the_control_plane_through_one_forward_to_the_gateway() -> None:
    value = netdev_value(NetConfig(EgressPolicy.ISOLATED, 8124, 42001))
    forwards = [p for p in value.split(",") if p.startswith("guestfwd=")]
    assert forwards == ["guestfwd=tcp:10.0.2.2:8124-tcp:127.0.0.1:8124"]
    assert ",,reconnect=1" in value  # QEMU option escaping of the chardev's own comma
    assert "restrict=on" in value and "host=10.0.2.254" in value  # 10.0.2.2 is the forward's
    remote = netdev_value(NetConfig(EgressPolicy.NAT, 8124, None, "192.0.2.10"))
    assert "guestfwd=tcp:10.0.2.2:8124-tcp:192.0.2.10:8124" in remote
    ipv6 = netdev_value(NetConfig(EgressPolicy.NAT, 8124, None, "fd00::1"))
    assert "guestfwd=tcp:10.0.2.2:8124-tcp:[fd00::1]:8124" in ipv6


def test_dry_run_preview_records_what_create_records() -> None:
    """The preview's metadata carries every field create writes from the spec: a dry run of a
    spec without crash restarts or with an anti-affinity group must show them."""
    from agentic_sandbox.fleet import FleetConfig, InstanceSpec, preview_domain_xml

    spec = InstanceSpec(
        instance_id="dev-1", image="img", anti_affinity="web", restart_on_crash=False
    )
    rec = parse_record(preview_domain_xml(spec, FleetConfig(data_dir="/d")))
    assert rec is not None
    assert rec.anti_affinity == "web"
    assert rec.restart_on_crash is False


def test_allowlist_is_restricted_like_isolated() -> None:
    """An allowlist guest's tools reach the proxy over the agent link: QEMU still drops
    everything else (the same netdev as isolated, the same one forward)."""
    assert netdev_value(NetConfig(EgressPolicy.ALLOWLIST, 8124, 42001)) == netdev_value(
        NetConfig(EgressPolicy.ISOLATED, 8124, 42001)
    )
    assert "restrict=on" in netdev_value(NetConfig(EgressPolicy.ALLOWLIST, 8124, 42001))


def _link_channel(root: ET.Element) -> ET.Element:
    (channel,) = root.findall("devices/channel")
    return channel


def test_the_link_also_has_a_virtio_serial_port_to_the_gateway() -> None:
    """The port the guest's agent prefers to the forward: QEMU connects it to the same gateway
    (this host's control address, the gateway's port) and again a second after it drops, and
    the guest finds it by the name its agent looks for."""
    from agentic_sandbox.agent.config import DEFAULT_SERIAL_PORT

    channel = _link_channel(
        parse(config(net=NetConfig(EgressPolicy.ISOLATED, 8124, 1, "192.0.2.7")))
    )
    assert channel.get("type") == "tcp"
    source = channel.find("source")
    assert source is not None and dict(source.attrib) == {
        "mode": "connect",
        "host": "192.0.2.7",
        "service": "8124",
    }
    assert source.find("reconnect").attrib == {"enabled": "yes", "timeout": "1"}
    assert channel.find("protocol").get("type") == "raw"
    target = channel.find("target")
    assert target.get("type") == "virtio"
    assert f"/dev/virtio-ports/{target.get('name')}" == DEFAULT_SERIAL_PORT


def test_a_clone_s_link_port_leads_to_its_own_host_s_gateway() -> None:
    src = build_domain_xml(config())
    ident = CloneIdentity(
        name="sbx-clone-1",
        uuid="11111111-2222-3333-4444-555555555555",
        overlay="/d/instances/sbx-clone-1.qcow2",
        serial_log="/d/instances/c.log",
        seed=None,
        net=NetConfig(EgressPolicy.ISOLATED, 9000, 42300, "198.51.100.4"),
        record=record(instance_id="clone-1", domain="sbx-clone-1"),
    )
    source = _link_channel(ET.fromstring(rewrite_for_clone(src, ident))).find("source")
    assert source is not None
    assert (source.get("host"), source.get("service")) == ("198.51.100.4", "9000")
    assert source.find("reconnect") is not None
    # a machine saved before the port existed stays without one (its memory has no such device)
    old = ET.fromstring(src)
    devices = old.find("devices")
    devices.remove(_link_channel(old))
    assert (
        ET.fromstring(rewrite_for_clone(ET.tostring(old, encoding="unicode"), ident)).findall(
            "devices/channel"
        )
        == []
    )
