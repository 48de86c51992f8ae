"""Placement: labels, capacity, reachability, anti-affinity, spreading."""

from __future__ import annotations

import pytest

from agentic_sandbox.fleet import NoCapacity
from agentic_sandbox.fleet.placement import HostLoad, PlacementRequest, choose_host


def host(name: str, **kw: object) -> HostLoad:
    base: dict[str, object] = dict(
        name=name,
        reachable=True,
        labels={},
        vcpu_capacity=8,
        memory_capacity_mib=8192,
        free_memory_mib=8192,
        committed_vcpus=0,
        committed_memory_mib=0,
        instances=0,
    )
    base.update(kw)
    return HostLoad(**base)  # type: ignore[arg-type]


def test_spreads_to_emptier_host() -> None:
    hosts = [host("a", committed_memory_mib=1024, committed_vcpus=1, instances=1), host("b")]
    assert choose_host(hosts, PlacementRequest(vcpus=1, memory_mib=512)) == "b"


def test_labels_must_match() -> None:
    hosts = [host("a"), host("b", labels={"gpu": "yes"})]
    assert choose_host(hosts, PlacementRequest(1, 512, labels={"gpu": "yes"})) == "b"
    with pytest.raises(NoCapacity) as ei:
        choose_host(hosts, PlacementRequest(1, 512, labels={"zone": "x"}))
    assert "labels" in str(ei.value)


def test_unreachable_and_full_hosts_are_skipped_with_reasons() -> None:
    hosts = [
        host("a", reachable=False),
        host("b", free_memory_mib=100),
        host("c", committed_vcpus=8),
    ]
    with pytest.raises(NoCapacity) as ei:
        choose_host(hosts, PlacementRequest(1, 512))
    msg = str(ei.value)
    assert "a: unreachable" in msg and "b: 100 MiB free" in msg and "c: vCPUs" in msg


def test_committed_memory_counts_even_when_host_reports_free() -> None:
    hosts = [host("a", committed_memory_mib=8000)]
    with pytest.raises(NoCapacity):
        choose_host(hosts, PlacementRequest(1, 512))


def test_anti_affinity_prefers_host_without_group() -> None:
    hosts = [
        host("a", groups={"web": 1}),
        host("b", committed_memory_mib=2048, instances=3, groups={}),
    ]
    assert choose_host(hosts, PlacementRequest(1, 512, anti_affinity="web")) == "b"
    assert choose_host(hosts, PlacementRequest(1, 512)) == "a"


def test_pinned() -> None:
    hosts = [host("a"), host("b")]
    assert choose_host(hosts, PlacementRequest(1, 512, pinned="b")) == "b"
    with pytest.raises(NoCapacity):
        choose_host(hosts, PlacementRequest(1, 512, pinned="zzz"))


def test_spreading_follows_commitments_not_a_noisy_free_memory_sample() -> None:
    # Both hosts share one machine: the busier one was sampled a moment later, after some
    # memory had been freed, so it reports a little more free. The empty host still wins.
    hosts = [
        host("a", vcpu_capacity=64, free_memory_mib=7000),
        host(
            "b",
            vcpu_capacity=64,
            free_memory_mib=7300,
            committed_memory_mib=512,
            committed_vcpus=1,
            instances=1,
        ),
    ]
    assert choose_host(hosts, PlacementRequest(1, 512)) == "a"


def test_free_memory_breaks_a_tie_between_equally_committed_hosts() -> None:
    hosts = [host("a", free_memory_mib=3000), host("b", free_memory_mib=7000)]
    assert choose_host(hosts, PlacementRequest(1, 512)) == "b"


def test_a_draining_host_takes_nothing_new_pinned_or_not() -> None:
    hosts = [host("a", draining=True), host("b", committed_memory_mib=6000, instances=5)]
    assert choose_host(hosts, PlacementRequest(1, 512)) == "b"  # though a is emptier
    with pytest.raises(NoCapacity, match="a: draining"):
        choose_host(hosts, PlacementRequest(1, 512, pinned="a"))
