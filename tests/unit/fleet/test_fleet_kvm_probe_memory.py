"""The KVM probe's answer is remembered per host under what it depends on, and only for that."""

from __future__ import annotations

import json
from pathlib import Path

from agentic_sandbox.fleet.kvm_probe import AccelReport, ProbeMemory, probe_key
from agentic_sandbox.fleet.models import Accel

KEY = {
    "host_kernel": "6.1.0-28-cloud-amd64 #1 SMP PREEMPT_DYNAMIC Debian 6.1.119-1",
    "qemu": "QEMU emulator version 7.2.15 (Debian 1:7.2+dfsg-7+deb12u13)",
    "probe_kernel": ["/boot/vmlinuz-6.1.0-28-cloud-amd64", [8123456, 1733000000000000000]],
    "dev_kvm": {
        "rdev": [10, 232],
        "ino": 391,
        "mode": 8630,
        "uid": 0,
        "gid": 104,
        "mtime_ns": 1,
        "ctime_ns": 2,
        "rw": True,
    },
}
HANGS = AccelReport(
    Accel.TCG, "a kernel under KVM did not boot within 8s (hangs here)", 8.0, probed_at=1764580000.0
)


def test_an_answer_is_recalled_for_the_same_key_and_says_it_was_remembered(tmp_path: Path) -> None:
    memory = ProbeMemory(str(tmp_path / "kvm-probe.json"))
    assert memory.recall(KEY) is None
    memory.remember(KEY, HANGS)
    got = memory.recall(KEY)
    assert got is not None and got.accel is Accel.TCG and got.remembered
    assert got.reason.startswith(HANGS.reason) and "remembered" in got.reason
    assert got.probed_at == HANGS.probed_at


def test_a_new_qemu_kernel_or_dev_kvm_means_probing_again(tmp_path: Path) -> None:
    memory = ProbeMemory(str(tmp_path / "kvm-probe.json"))
    memory.remember(KEY, HANGS)
    for field, value in (
        ("qemu", "QEMU emulator version 8.2.0"),
        ("host_kernel", "6.1.0-29-cloud-amd64 #1 SMP PREEMPT_DYNAMIC Debian 6.1.123-1"),
        ("dev_kvm", {**KEY["dev_kvm"], "ino": 402}),  # a reboot or a module reload
        ("dev_kvm", {**KEY["dev_kvm"], "rw": False}),  # a permission change
        ("dev_kvm", None),  # the node is gone
    ):
        assert memory.recall({**KEY, field: value}) is None, field


def test_only_fresh_answers_are_remembered_and_a_bad_file_is_no_answer(tmp_path: Path) -> None:
    path = tmp_path / "kvm-probe.json"
    memory = ProbeMemory(str(path))
    memory.remember(KEY, HANGS)
    recalled = memory.recall(KEY)
    assert recalled is not None
    memory.remember(KEY, AccelReport(Accel.KVM, "kernel booted under kvm", remembered=True))
    assert json.loads(path.read_text())["report"]["accel"] == "tcg"
    path.write_text("{not json")
    assert memory.recall(KEY) is None
    path.write_text(json.dumps({"key": KEY, "report": {"accel": "warp"}}))
    assert memory.recall(KEY) is None


def test_the_key_of_this_machine_is_stable_and_names_what_the_answer_depends_on() -> None:
    first, second = probe_key(), probe_key()
    assert first == second
    assert set(first) == {"host_kernel", "qemu", "probe_kernel", "dev_kvm"}
    assert first["qemu"].startswith("QEMU emulator version"), first["qemu"]
