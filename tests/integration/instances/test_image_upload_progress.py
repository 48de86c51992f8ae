"""A host that lacks an image gets it on the first placement, and the provision operation
shows it: an `uploading` stage with the image, the host and its bytes; later creates find it."""

from __future__ import annotations

import os

from agentic_sandbox.images import ImageStore
from tests.integration.instances.conftest import IMAGE
from tests.integration.instances.test_instances_api import create
from tests.support.inproc_server import Running


async def test_the_first_create_on_a_host_shows_its_image_upload(fleet_server: Running) -> None:
    r = fleet_server
    built = ImageStore(r.svc.settings.data_dir / "images").get(IMAGE)
    files = [built.disk]
    if built.direct_kernel_boot:
        files += [f for f in (built.kernel, built.initrd) if f is not None]
    size = sum(os.path.getsize(f) for f in files)

    op = await create(r, {"id": "up-1", "image": IMAGE, "wait_ready": False})
    assert op["state"] == "succeeded", op
    names = [s["name"] for s in op["stages"]]
    assert names.index("placing") < names.index("uploading") < names.index("disk"), names
    upload = next(s for s in op["stages"] if s["name"] == "uploading")
    assert upload["host"] == "local" and upload["image"].startswith(IMAGE), upload
    # every file of the image that went to the host, summed: all of it arrived
    assert upload["files"] == len(files), (upload, files)
    assert upload["bytes_done"] == upload["bytes_total"] == size, (upload, size)

    status, events, _ = await r.call("GET", "/api/v1/events?type=operation.stage&limit=100")
    assert status == 200, events
    mine = [e["data"]["stage"] for e in events["items"] if e["data"]["operation_id"] == op["id"]]
    assert mine.count("uploading") == 1, mine  # progress updates are no new stage events

    again = await create(r, {"id": "up-2", "image": IMAGE, "wait_ready": False})
    assert again["state"] == "succeeded", again
    assert "uploading" not in [s["name"] for s in again["stages"]], again["stages"]
