"""A server whose fleet runs on libvirt's test driver (one private node per test), with a fake
image in its cache. No agents: creates do not wait for enrollment."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agentic_sandbox.broker.instances import FleetComponent
from agentic_sandbox.images import ImageStore
from tests.support.fake_images import publish_fake
from tests.support.inproc_server import Running, make_settings, start_server
from tests.support.libvirt_testdriver import node_uri

IMAGE = "fake-0123456789ab"


@pytest.fixture
async def fleet_server(tmp_path: Path) -> AsyncIterator[Running]:
    data = tmp_path / "data"
    publish_fake(ImageStore(data / "images"), IMAGE, recipe_name="fake")
    settings = make_settings(tmp_path, libvirt_uri=node_uri(tmp_path, "local"), kvm_probe=False)
    async with start_server(settings, components=lambda svc: [FleetComponent(svc)]) as r:
        yield r
