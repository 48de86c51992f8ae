"""Guest images: recipes, the builder (debootstrap -> ext4 -> qcow2 + kernel/initrd), the cache.

Public face (other packages import only these names)::

    from agentic_sandbox.images import ImageBuilder, ImageStore, BuiltImage, load_recipe

    image = ImageBuilder(cache_dir).build("debian-12-agent", progress=print)
    image.disk            # read-only qcow2 base for overlays
    image.kernel, image.initrd, image.kernel_cmdline   # direct kernel boot
    image.agent_python    # /opt/agentic-sandbox/venv/bin/python in the guest
    image.needs_agent_runtime   # True for imported cloud images

See docs/images.md for the layout, guest facts and numbers.
"""

from pathlib import Path

from agentic_sandbox.images.builder import ImageBuilder, Tools, build_image
from agentic_sandbox.images.errors import (
    BuildCancelled,
    BuildError,
    ImageError,
    ImageNotFound,
    InvalidImage,
    RecipeError,
)
from agentic_sandbox.images.manifest import (
    BootInfo,
    BuiltImage,
    DiskInfo,
    GuestInfo,
    ImageKind,
    Manifest,
)
from agentic_sandbox.images.progress import STAGE_NAMES, Progress, ProgressCallback
from agentic_sandbox.images.recipe import (
    BUILDER_VERSION,
    Recipe,
    list_recipes,
    load_recipe,
    parse_recipe,
)
from agentic_sandbox.images.store import ImageStore, default_cache_dir

#: Guest facts every image built by this package guarantees (provisioning relies on them).
AGENT_VENV = "/opt/agentic-sandbox/venv"
AGENT_PYTHON = AGENT_VENV + "/bin/python"
NOCLOUD_LABEL = "cidata"


def import_cloud_image(
    path: str | Path,
    cache_dir: str | Path | None = None,
    *,
    name: str | None = None,
    link: bool = False,
) -> BuiltImage:
    """Shorthand for `ImageBuilder(cache_dir).import_cloud_image(path, ...)`."""
    return ImageBuilder(cache_dir).import_cloud_image(path, name=name, link=link)


__all__ = [
    "AGENT_PYTHON",
    "AGENT_VENV",
    "BUILDER_VERSION",
    "NOCLOUD_LABEL",
    "STAGE_NAMES",
    "BootInfo",
    "BuildCancelled",
    "BuildError",
    "BuiltImage",
    "DiskInfo",
    "GuestInfo",
    "ImageBuilder",
    "ImageError",
    "ImageKind",
    "ImageNotFound",
    "ImageStore",
    "InvalidImage",
    "Manifest",
    "Progress",
    "ProgressCallback",
    "Recipe",
    "RecipeError",
    "Tools",
    "build_image",
    "default_cache_dir",
    "import_cloud_image",
    "list_recipes",
    "load_recipe",
    "parse_recipe",
]
