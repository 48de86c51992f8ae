"""`python -m agentic_sandbox.images`: build, list, show, import, delete images; list recipes;
clean the cache."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import TextIO

from agentic_sandbox.images.builder import ImageBuilder
from agentic_sandbox.images.errors import BuildCancelled, BuildError, ImageError
from agentic_sandbox.images.manifest import BuiltImage
from agentic_sandbox.images.progress import Progress
from agentic_sandbox.images.recipe import list_recipes, load_recipe
from agentic_sandbox.images.store import ImageStore, default_cache_dir


class _Printer:
    """Progress on stderr: one rewritten line on a terminal, else a line per stage/10%."""

    def __init__(self, stream: TextIO, quiet: bool) -> None:
        self.stream = stream
        self.quiet = quiet
        self.tty = stream.isatty()
        self._last_stage = ""
        self._last_tenth = -1

    def __call__(self, p: Progress) -> None:
        if self.quiet:
            return
        line = f"[{p.fraction * 100:5.1f}%] {p.stage:<11} {p.message}"
        if self.tty:
            self.stream.write("\r\033[K" + line[:150])
            if p.stage in ("done", "cached"):
                self.stream.write("\n")
        else:
            tenth = int(p.fraction * 10)
            if p.stage != self._last_stage or tenth != self._last_tenth:
                self.stream.write(line + "\n")
            self._last_stage, self._last_tenth = p.stage, tenth
        self.stream.flush()


def _describe(image: BuiltImage) -> dict[str, object]:
    m = image.manifest
    return {
        "name": image.name,
        "kind": image.kind,
        "recipe": m.recipe_name,
        "path": str(image.path),
        "disk": str(image.disk),
        "kernel": str(image.kernel) if image.kernel else None,
        "initrd": str(image.initrd) if image.initrd else None,
        "cmdline": image.kernel_cmdline,
        "kernel_version": m.boot.kernel_version,
        "agent_python": image.agent_python,
        "needs_agent_runtime": image.needs_agent_runtime,
        "disk_bytes": m.disk.actual_size,
        "virtual_size": m.disk.virtual_size,
        "created_at": m.created_at,
        "cached": image.cached,
        "build_seconds": m.timings.get("total"),
    }


def _cmd_build(args: argparse.Namespace) -> int:
    builder = ImageBuilder(args.cache_dir)
    recipe = load_recipe(args.recipe)
    if args.mirror:
        recipe = recipe.model_copy(update={"mirror": args.mirror})
        recipe = type(recipe).model_validate(recipe.model_dump())
    cancel = threading.Event()

    def on_term(signum: int, frame: FrameType | None) -> None:
        cancel.set()

    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_term) if in_main else None
    printer = _Printer(sys.stderr, args.quiet)
    try:
        image = builder.build(recipe, progress=printer, cancel=cancel)
    except (BuildCancelled, KeyboardInterrupt):
        print("\nbuild cancelled; temporary files removed", file=sys.stderr)
        return 130
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    if args.json:
        print(json.dumps(_describe(image), indent=2))
    else:
        state = "cached" if image.cached else "built"
        print(
            f"{state} {image.name}\n  disk   {image.disk}\n  kernel {image.kernel}\n"
            f"  initrd {image.initrd}\n  append {image.kernel_cmdline}"
        )
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    store = ImageStore(args.cache_dir)
    images = store.list()
    if args.json:
        print(json.dumps([_describe(i) for i in images], indent=2))
        return 0
    if not images:
        print(f"no images in {store.images_dir}")
        return 0
    print(f"{'NAME':<34} {'KIND':<6} {'SIZE':>9} {'CREATED':<21} KERNEL")
    for i in images:
        size = f"{i.manifest.disk.actual_size / 2**20:.0f} MiB"
        print(
            f"{i.name:<34} {i.kind:<6} {size:>9} {i.manifest.created_at:<21} "
            f"{i.manifest.boot.kernel_version or '-'}"
        )
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    image = ImageStore(args.cache_dir).get(args.name)
    print(image.manifest.to_json(), end="")
    return 0


def _cmd_delete(args: argparse.Namespace) -> int:
    ImageStore(args.cache_dir).delete(args.name)
    print(f"deleted {args.name}")
    return 0


def _cmd_import(args: argparse.Namespace) -> int:
    builder = ImageBuilder(args.cache_dir)
    image = builder.import_cloud_image(
        args.path, name=args.name, link=args.link, progress=_Printer(sys.stderr, args.quiet)
    )
    print(json.dumps(_describe(image), indent=2) if args.json else f"imported {image.name}")
    return 0


def _cmd_recipes(args: argparse.Namespace) -> int:
    for name in list_recipes():
        recipe = load_recipe(name)
        print(f"{name:<24} -> {recipe.image_name()}")
    return 0


def _cmd_name(args: argparse.Namespace) -> int:
    print(load_recipe(args.recipe).image_name())
    return 0


def _cmd_clean(args: argparse.Namespace) -> int:
    removed = ImageStore(args.cache_dir).clean_stale()
    for p in removed:
        print(f"removed {p}")
    print(f"{len(removed)} stale entries removed")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m agentic_sandbox.images",
        description="agentic-sandbox guest image builder and cache",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help=f"image cache directory (default: {default_cache_dir()})",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("build", parents=[common], help="build a recipe's image (or reuse it)")
    p.add_argument("recipe", help="recipe name (see `recipes`) or path to a recipe YAML file")
    p.add_argument("--mirror", help="Debian mirror URL (changes the image hash)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress output")
    p.set_defaults(func=_cmd_build)

    p = sub.add_parser("list", parents=[common], help="list complete images")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_list)

    p = sub.add_parser("show", parents=[common], help="print an image's manifest")
    p.add_argument("name")
    p.set_defaults(func=_cmd_show)

    p = sub.add_parser("delete", parents=[common], help="delete an image")
    p.add_argument("name")
    p.set_defaults(func=_cmd_delete)

    p = sub.add_parser("import", parents=[common], help="import a cloud image (qcow2)")
    p.add_argument("path", type=Path)
    p.add_argument("--name", help="name prefix (default: cloud-<file name>)")
    p.add_argument("--link", action="store_true", help="hard-link instead of copying")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", "-q", action="store_true")
    p.set_defaults(func=_cmd_import)

    p = sub.add_parser("recipes", help="list shipped recipes and their image names")
    p.set_defaults(func=_cmd_recipes)

    p = sub.add_parser("name", help="print the image name a recipe builds, without building")
    p.add_argument("recipe")
    p.set_defaults(func=_cmd_name)

    p = sub.add_parser("clean", parents=[common], help="remove stale temp dirs and partial images")
    p.set_defaults(func=_cmd_clean)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BuildError as err:
        print(f"error: build failed at {err}", file=sys.stderr)
        return 1
    except ImageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
