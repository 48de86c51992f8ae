"""Guest images in the server: the cache, builds as operations, the `images` table."""

from __future__ import annotations

import asyncio
from pathlib import Path

from sqlalchemy import func, select

from agentic_sandbox.broker.auth.principal import Principal
from agentic_sandbox.broker.instances.errors import ConflictError, InvalidInput, NotFoundError
from agentic_sandbox.broker.operations import OperationFailed, OperationRunner, Progress
from agentic_sandbox.broker.services import Services
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.images import BuiltImage, ImageBuilder, ImageNotFound, ImageStore, list_recipes
from agentic_sandbox.images import Progress as BuildProgress


class ImageCatalog:
    """The image cache and its builder. `builder` may be replaced before the server starts (a
    test's instant builder)."""

    def __init__(self, svc: Services, ops: OperationRunner, images_dir: Path) -> None:
        self._svc = svc
        self._ops = ops
        self.store = ImageStore(images_dir)
        self.builder = ImageBuilder(images_dir)

    def resolve(self, name: str | None) -> BuiltImage:
        """An image by name, or the cached build of a recipe by recipe name (default: the
        server's default recipe). A recipe that is not built yet is `image-not-built`."""
        name = name or self._svc.settings.default_recipe
        try:
            return self.store.get(name)
        except ImageNotFound:
            pass
        try:
            cached = self.builder.cached(name)
        except Exception:  # not a recipe name either
            cached = None
        if cached is not None:
            return cached
        if name in list_recipes():  # a recipe that is not built yet: say how to build it
            raise InvalidInput(
                "image",
                f"recipe {name!r} is not built yet; build it first with "
                f"`sandboxctl image build {name}` "
                f'(POST /api/v2/admin/images {{"recipe": "{name}"}})',
                summary="unknown image",
                code="image-not-built",
                extra={"recipe": name},
            )
        raise InvalidInput(
            "image",
            f"no image or recipe named {name!r} (`sandboxctl image list` shows the images)",
            summary="unknown image",
        )

    def available(self) -> list[BuiltImage]:
        """Every complete image in the cache, oldest first."""
        return self.store.list()

    async def build(self, who: Principal, recipe: str) -> m.Operation:
        """Build a recipe's image as an operation (a cached build ends it at once)."""
        known = list_recipes()
        if recipe not in known:
            raise InvalidInput(
                "recipe",
                f"unknown recipe {recipe!r}; known: {', '.join(known)}",
                summary="unknown recipe",
            )
        owner, actor = who.subject, who.actor

        async def body(progress: Progress) -> dict[str, object]:
            return await self._build(recipe, progress, owner=owner, actor=actor)

        return await self._ops.submit(
            kind="image-build",
            subject_type="image",
            subject_id=self.builder.image_name(recipe),
            owner=owner,
            actor=actor,
            body=body,
        )

    async def _build(
        self, recipe: str, progress: Progress, *, owner: str, actor: str
    ) -> dict[str, object]:
        metrics = self._svc.metrics
        loop = asyncio.get_running_loop()
        started = loop.time()

        def on_progress(p: BuildProgress) -> None:
            loop.call_soon_threadsafe(progress.stage, p.stage)

        try:
            image = await self.builder.build_async(recipe, progress=on_progress)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            metrics.image_build.labels("failed", "false").observe(loop.time() - started)
            raise OperationFailed(getattr(exc, "stage", None) or "build", str(exc)) from None
        seconds = loop.time() - started
        metrics.image_build.labels("ok", str(image.cached).lower()).observe(seconds)
        await self.record(image, owner)
        result: dict[str, object] = {
            "image": image.name,
            "cached": image.cached,
            "seconds": round(seconds, 3),
        }
        self._svc.events.publish("image.built", actor=actor, data=dict(result))
        return result

    async def record(self, image: BuiltImage, owner: str) -> None:
        """Write (or refresh) the image's row."""
        async with self._svc.db.session() as s:
            row = await s.get(m.Image, image.name)
            if row is None:
                row = m.Image(name=image.name, owner=owner)
                s.add(row)
            row.recipe = image.manifest.recipe_name
            row.kind = image.kind
            row.content_hash = image.manifest.content_hash
            row.path = str(image.path)
            row.size_bytes = image.manifest.disk.actual_size
            row.state = "ready"
            row.manifest = image.manifest.model_dump(mode="json")

    async def delete(self, who: Principal, name: str) -> None:
        """Delete an image no live instance uses, with its row."""
        async with self._svc.db.session() as s:
            users = await s.scalar(
                select(func.count())
                .select_from(m.Instance)
                .where(m.Instance.image == name, m.Instance.deleted_at.is_(None))
            )
        if users:
            raise ConflictError(f"{users} instance(s) still use image {name}")
        try:
            self.store.delete(name)
        except ImageNotFound:
            raise NotFoundError("image", name) from None
        async with self._svc.db.session() as s:
            row = await s.get(m.Image, name)
            if row is not None:
                await s.delete(row)
        self._svc.audit.record(who.actor, "image.delete", "image", name)
