"""Versioned loadouts on a real PostgreSQL: the shipped files seeded, concurrent saves racing
for the next version number (each gets its own, identical content one), and compare-and-set
activation with exactly one winner among racing activations."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agentic_sandbox.broker.instances import FleetComponent
from tests.support.inproc_server import make_settings, start_server
from tests.support.libvirt_testdriver import node_uri

LOADOUTS = "/api/v2/admin/loadouts"


async def test_loadout_versions_on_postgres(pg_url: str, tmp_path: Path) -> None:
    settings = make_settings(
        tmp_path, database_url=pg_url, libvirt_uri=node_uri(tmp_path, "local"), kvm_probe=False
    )
    async with start_server(settings, components=lambda svc: [FleetComponent(svc)]) as r:
        status, body, _ = await r.call("GET", f"{LOADOUTS}/dev/versions")
        assert status == 200 and body["items"][0]["extends"] == {"name": "minimal", "version": 1}

        async def save(description: str) -> tuple[int, int, str]:
            spec = {"extends": "minimal", "description": description}
            status, body, _ = await r.call("POST", LOADOUTS, json={"name": "race", "spec": spec})
            assert status in (200, 201), body
            return status, body["version"], body["digest"]

        first = await save("base")
        assert first[:2] == (201, 1)
        results = await asyncio.gather(*(save(f"d{i % 4}") for i in range(12)))
        by_digest: dict[str, set[int]] = {}
        for _, version, digest in results:
            by_digest.setdefault(digest, set()).add(version)
        assert all(len(v) == 1 for v in by_digest.values()), by_digest  # one version a content
        numbers = sorted(v for vs in by_digest.values() for v in vs)
        assert numbers == [2, 3, 4, 5], numbers  # no gaps, no duplicates

        async def activate(version: int) -> int:
            status, _, _ = await r.call(
                "POST",
                f"{LOADOUTS}/race/activate",
                json={"version": version, "expected_version": 1},
            )
            return status

        outcomes = await asyncio.gather(*(activate(v) for v in (2, 3, 4, 5)))
        assert sorted(outcomes) == [200, 409, 409, 409], outcomes
        status, body, _ = await r.call("GET", f"{LOADOUTS}/race/versions")
        assert body["active_version"] in (2, 3, 4, 5)
