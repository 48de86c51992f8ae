"""Choosing a host for a new instance: labels, free memory/vCPU, soft anti-affinity."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .errors import NoCapacity


@dataclass(frozen=True)
class HostLoad:
    name: str
    reachable: bool
    labels: Mapping[str, str]
    vcpu_capacity: int
    memory_capacity_mib: int
    free_memory_mib: int  # what the host reports free right now, minus its reserve
    committed_vcpus: int
    committed_memory_mib: int
    instances: int
    groups: Mapping[str, int] = field(default_factory=dict)  # anti-affinity group -> count
    draining: bool = False  # takes no new instances


@dataclass(frozen=True)
class PlacementRequest:
    vcpus: int
    memory_mib: int
    labels: Mapping[str, str] = field(default_factory=dict)
    anti_affinity: str | None = None
    pinned: str | None = None


def available_memory(h: HostLoad) -> int:
    return min(h.free_memory_mib, h.memory_capacity_mib - h.committed_memory_mib)


def choose_host(hosts: Sequence[HostLoad], req: PlacementRequest) -> str:
    """The best host for ``req``. Raises `NoCapacity` naming why each host was rejected."""
    reasons: list[str] = []
    fits: list[HostLoad] = []
    for h in hosts:
        if req.pinned and h.name != req.pinned:
            continue
        if not h.reachable:
            reasons.append(f"{h.name}: unreachable")
            continue
        if h.draining:
            reasons.append(f"{h.name}: draining")
            continue
        missing = [k for k, v in req.labels.items() if h.labels.get(k) != v]
        if missing:
            reasons.append(f"{h.name}: labels {missing} do not match")
            continue
        if h.committed_vcpus + req.vcpus > h.vcpu_capacity:
            reasons.append(f"{h.name}: vCPUs {h.committed_vcpus}+{req.vcpus}>{h.vcpu_capacity}")
            continue
        if available_memory(h) < req.memory_mib:
            reasons.append(f"{h.name}: {available_memory(h)} MiB free < {req.memory_mib} MiB")
            continue
        fits.append(h)
    if not fits:
        if req.pinned and not reasons:
            reasons.append(f"no host named {req.pinned}")
        raise NoCapacity("no host can take the instance: " + "; ".join(reasons or ["no hosts"]))

    def score(h: HostLoad) -> tuple[float, ...]:
        same_group = h.groups.get(req.anti_affinity, 0) if req.anti_affinity else 0
        # Rank by what the fleet has committed, not by the free memory a host reports right
        # now: that number moves with everything else on the machine (page cache, a guest
        # that is still shutting down), so two samples taken a moment apart would make
        # spreading a coin toss. Reported free memory is a hard limit above, and breaks ties.
        mem_left = h.memory_capacity_mib - h.committed_memory_mib - req.memory_mib
        mem_frac = mem_left / max(h.memory_capacity_mib, 1)
        cpu_frac = (h.vcpu_capacity - h.committed_vcpus - req.vcpus) / max(h.vcpu_capacity, 1)
        free_gib = available_memory(h) // 1024
        # fewer of the same group first, then the emptiest host, then fewest instances, then
        # the most memory really free (whole GiB, so noise does not decide), then the name
        return (same_group, -round(min(mem_frac, cpu_frac), 3), h.instances, -free_gib)

    return min(fits, key=lambda h: (*score(h), h.name)).name
