"""Admin routes for guest images: build, list, delete."""

from __future__ import annotations

from pydantic import Field

from agentic_sandbox.broker.auth.principal import Role
from agentic_sandbox.broker.http.routing import Call, NoBody, NoQuery
from agentic_sandbox.broker.http.schemas import Input, Output
from agentic_sandbox.broker.instances.api.models import OperationOut
from agentic_sandbox.broker.instances.api.problems import FleetRoutes
from agentic_sandbox.broker.instances.keys import IMAGES
from agentic_sandbox.images import BuiltImage

api = FleetRoutes()


class ImageBuild(Input):
    recipe: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")


class ImageOut(Output):
    name: str
    kind: str
    recipe: str | None
    state: str
    size_bytes: int | None
    created_at: str | None
    needs_agent_runtime: bool


class ImageList(Output):
    items: list[ImageOut]


def image_out(image: BuiltImage) -> ImageOut:
    man = image.manifest
    return ImageOut(
        name=image.name,
        kind=image.kind,
        recipe=man.recipe_name,
        state="ready",
        size_bytes=man.disk.actual_size,
        created_at=man.created_at,
        needs_agent_runtime=image.needs_agent_runtime,
    )


@api.post(
    "/api/v2/admin/images",
    body=ImageBuild,
    response=OperationOut,
    status=202,
    role=Role.admin,
    summary="Build an image from a recipe (a cached build is reused at once)",
    tag="images",
)
async def build_image(call: Call[ImageBuild, NoQuery]) -> OperationOut:
    op = await call.app[IMAGES].build(call.require_principal(), call.body.recipe)
    return OperationOut.model_validate(op)


@api.get(
    "/api/v2/admin/images",
    response=ImageList,
    role=Role.viewer,
    summary="Images in the cache",
    tag="images",
)
async def list_images(call: Call[NoBody, NoQuery]) -> ImageList:
    return ImageList(items=[image_out(i) for i in call.app[IMAGES].available()])


@api.delete(
    "/api/v2/admin/images/{name}",
    role=Role.admin,
    summary="Delete an image from the cache",
    tag="images",
    responses={409: "instances still use it"},
)
async def delete_image(call: Call[NoBody, NoQuery]) -> None:
    await call.app[IMAGES].delete(call.require_principal(), call.match["name"])
