"""Image recipes: YAML data validated by pydantic, and the content hash that names an image."""

from __future__ import annotations

import functools
import hashlib
import json
import re
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

from agentic_sandbox.images.errors import RecipeError

#: Bumped whenever the builder's output for the same recipe changes in a way the code digest
#: below does not capture (e.g. a changed external tool invocation policy). Part of every hash.
BUILDER_VERSION = "1"

#: The modules whose code decides what an image contains; their digest is part of every image's
#: hash, so an edited builder never reuses an image an older builder made.
_OUTPUT_MODULES = ("builder.py", "rootfs.py", "runtime.py", "disk.py", "manifest.py")

#: Where the recipes that ship with the project live.
RECIPES_DIR = Path(__file__).resolve().parent / "recipes"

RecipeName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9.-]{0,47}$")]
PackageName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9+.-]{0,99}$")]
UnitName = Annotated[
    str,
    StringConstraints(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9@_.:-]{0,200}\."
        r"(service|timer|socket|target|path|mount|automount|swap|slice)$"
    ),
]
#: Exact pins only: the agent runtime must be reproducible.
PinnedRequirement = Annotated[
    str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}==[A-Za-z0-9.+!-]{1,50}$")
]
SuiteName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9-]{1,30}$")]
KernelArg = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.,=:/@+-]{1,200}$")]
Platform = Annotated[str, StringConstraints(pattern=r"^[a-z0-9_]{1,60}$")]
LockFileName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}\.txt$")]
_LOCK_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", re.M)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins(text: str) -> dict[str, str]:
    """{normalised name: version} of a hash-pinned requirements lock."""
    return {_norm(m.group(1)): m.group(2) for m in _LOCK_PIN.finditer(text)}


def _check_abs_path(value: str) -> str:
    path = PurePosixPath(value)
    if not path.is_absolute():
        raise ValueError("must be an absolute path")
    if ".." in path.parts:
        raise ValueError("must not contain '..'")
    if any(c in value for c in "\0\n"):
        raise ValueError("must not contain NUL or newline")
    if str(path) == "/":
        raise ValueError("must not be '/'")
    return str(path)


GuestPath = Annotated[str, AfterValidator(_check_abs_path)]


def _check_mode(value: str) -> str:
    if not re.fullmatch(r"0?[0-7]{3,4}", value):
        raise ValueError("must be an octal mode such as '0644'")
    return value


FileMode = Annotated[str, AfterValidator(_check_mode)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GuestFile(_Model):
    """A file written into the root filesystem before the image is sealed."""

    path: GuestPath
    content: str
    mode: FileMode = "0644"


class AgentRuntime(_Model):
    """The agent's Python runtime baked into the image as a venv built by the guest's python3."""

    venv_path: GuestPath = "/opt/agentic-sandbox/venv"
    python: GuestPath = "/usr/bin/python3"
    #: The guest python's X.Y, used to fetch matching wheels on the host.
    python_version: Annotated[str, StringConstraints(pattern=r"^3\.[0-9]{1,2}$")] = "3.11"
    requirements: list[PinnedRequirement] = Field(min_length=1)
    #: A hash-pinned lock beside the recipe (`tools/lock.sh` writes it): wheels are downloaded
    #: and installed with `--require-hashes` from it, and its pins must be `requirements`.
    requirements_lock: LockFileName | None = None
    wheel_platforms: list[Platform] = Field(
        default_factory=lambda: ["manylinux_2_36_x86_64", "manylinux2014_x86_64"], min_length=1
    )
    #: The folder the lock is read from (the recipe's own); set by `load_recipe`.
    _lock_dir: Path = PrivateAttr(default=RECIPES_DIR)

    def lock_path(self) -> Path | None:
        return None if self.requirements_lock is None else self._lock_dir / self.requirements_lock

    def check_lock(self, lock_dir: Path) -> None:
        """The lock exists and pins exactly `requirements` (RecipeError naming the field)."""
        self._lock_dir = lock_dir
        path = self.lock_path()
        if path is None:
            return
        try:
            pins = lock_pins(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise RecipeError(
                f"runtime.requirements_lock: cannot read {path}: {exc.strerror}"
            ) from None
        wanted = {_norm(r.split("==")[0]): r.split("==", 1)[1] for r in self.requirements}
        if pins != wanted:
            diff = sorted(
                f"{n}: recipe {wanted.get(n, '-')}, lock {pins.get(n, '-')}"
                for n in set(pins) | set(wanted)
                if pins.get(n) != wanted.get(n)
            )
            raise RecipeError(
                f"runtime.requirements_lock: {path.name} does not pin runtime.requirements "
                f"({'; '.join(diff)}); run tools/lock.sh and copy its pins into the recipe"
            )

    @field_validator("requirements")
    @classmethod
    def _sort_requirements(cls, value: list[str]) -> list[str]:
        names = [r.split("==", 1)[0].lower().replace("_", "-") for r in value]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"requirement listed twice: {', '.join(dupes)}")
        return sorted(value, key=str.lower)


class Customize(_Model):
    """How the debootstrapped tree is turned into a cloud-init ready guest."""

    hostname: Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")] = (
        "agentic-sandbox"
    )
    locale: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.@-]{1,40}$")] = "C.UTF-8"
    timezone: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_+/-]{1,60}$")] = "Etc/UTC"
    #: Units masked (linked to /dev/null): timers and jobs that would touch the network or disk.
    mask_units: list[UnitName] = Field(default_factory=list)
    #: Units enabled in the image (their [Install] WantedBy links are made).
    enable_units: list[UnitName] = Field(default_factory=list)
    #: Written as /etc/cloud/cloud.cfg.d/90_agentic_sandbox.cfg.
    cloud_init: dict[str, Any] = Field(default_factory=dict)
    files: list[GuestFile] = Field(default_factory=list)
    #: argv lists run inside the chroot after everything else (never through a shell).
    commands: list[Annotated[list[str], Field(min_length=1)]] = Field(default_factory=list)

    @field_validator("mask_units", "enable_units")
    @classmethod
    def _sorted_units(cls, value: list[str]) -> list[str]:
        return sorted(set(value))

    @field_validator("cloud_init")
    @classmethod
    def _nocloud(cls, value: dict[str, Any]) -> dict[str, Any]:
        sources = value.get("datasource_list")
        if sources is not None and (not isinstance(sources, list) or "NoCloud" not in sources):
            raise ValueError("datasource_list must be a list that includes NoCloud")
        return value

    @model_validator(mode="after")
    def _no_overlap(self) -> Customize:
        both = set(self.mask_units) & set(self.enable_units)
        if both:
            raise ValueError(f"units both masked and enabled: {', '.join(sorted(both))}")
        return self


class Disk(_Model):
    """The disk the root filesystem is written to."""

    format: Literal["qcow2"] = "qcow2"
    #: qcow2 cluster compression. zstd: ~2.7x smaller for ~2.5 s more build time and no
    #: measurable boot cost under TCG (see docs/images.md); zlib is slower to build.
    compression: Literal["none", "zlib", "zstd"] = "zstd"
    filesystem: Literal["ext4"] = "ext4"
    #: ext4 volume label (at most 16 bytes); the kernel finds the root by it.
    root_label: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,16}$")] = "agentic-root"
    #: Free space left in the filesystem on top of the files (overlays may also grow it).
    free_space_mib: int = Field(default=256, ge=0, le=65536)
    #: Kernel arguments after `root=LABEL=<root_label> ro`.
    kernel_args: list[KernelArg] = Field(
        default_factory=lambda: ["console=ttyS0,115200n8", "net.ifnames=0"]
    )


class Recipe(_Model):
    """A guest image recipe. Everything except `description` decides the image's content hash."""

    schema_version: Literal[1] = 1
    name: RecipeName
    description: str = ""
    distribution: Literal["debian"] = "debian"
    suite: SuiteName
    mirror: Annotated[str, StringConstraints(pattern=r"^(https?|file)://[^\s'\"]{1,500}$")]
    variant: Literal["minbase", "buildd", "default"] = "minbase"
    architecture: Literal["amd64"] = "amd64"
    components: list[Annotated[str, StringConstraints(pattern=r"^[a-z-]{1,30}$")]] = Field(
        default_factory=lambda: ["main"], min_length=1
    )
    packages: list[PackageName] = Field(min_length=1)
    kernel_package: PackageName
    runtime: AgentRuntime
    customize: Customize = Field(default_factory=Customize)
    disk: Disk = Field(default_factory=Disk)

    @field_validator("packages")
    @classmethod
    def _sorted_packages(cls, value: list[str]) -> list[str]:
        return sorted(set(value))

    @model_validator(mode="after")
    def _needs(self) -> Recipe:
        missing = [p for p in ("python3", "python3-venv", "cloud-init") if p not in self.packages]
        if missing:
            raise ValueError(f"packages must include {', '.join(missing)}")
        return self

    # ---- identity -------------------------------------------------------------------------

    def hash_input(self) -> dict[str, Any]:
        """What the content hash covers: the builder (version and code digest) and every
        content-deciding field of the recipe."""
        return {
            "builder_version": BUILDER_VERSION,
            "builder_code": builder_code_digest(),
            "recipe": self.model_dump(mode="json", exclude={"description"}),
        }

    def content_hash(self) -> str:
        """sha256 (hex) over the canonical JSON of `hash_input()`: stable across runs and hosts."""
        blob = json.dumps(self.hash_input(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    def image_name(self) -> str:
        """`<recipe>-<hash12>`: the name of the image this recipe builds."""
        return f"{self.name}-{self.content_hash()[:12]}"

    def all_packages(self) -> list[str]:
        """The debootstrap include list: packages plus the kernel, sorted."""
        return sorted({*self.packages, self.kernel_package})

    def kernel_cmdline(self) -> str:
        return " ".join([f"root=LABEL={self.disk.root_label}", "ro", *self.disk.kernel_args])


@functools.cache
def builder_code_digest() -> str:
    """sha256 (first 16 hex) over the source of the modules that decide an image's content."""
    digest = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in _OUTPUT_MODULES:
        digest.update(name.encode() + b"\0")
        digest.update((here / name).read_bytes().replace(b"\r\n", b"\n"))
    return digest.hexdigest()[:16]


# ---- loading ----------------------------------------------------------------------------------


def format_validation_error(source: str, err: ValidationError) -> str:
    """One line per problem, each naming the field path (e.g. `runtime.requirements.0`)."""
    lines = [f"invalid recipe {source}:"]
    for item in err.errors():
        loc = ".".join(str(p) for p in item["loc"]) or "(top level)"
        lines.append(f"  {loc}: {item['msg']}")
    return "\n".join(lines)


def parse_recipe(data: Any, source: str = "<data>") -> Recipe:
    """Validate already-parsed YAML/JSON data as a recipe; raises RecipeError naming the field."""
    if not isinstance(data, dict):
        raise RecipeError(f"invalid recipe {source}: top level must be a mapping")
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise RecipeError(format_validation_error(source, err)) from None


def parse_recipe_text(text: str, source: str = "<text>") -> Recipe:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise RecipeError(f"invalid recipe {source}: not valid YAML: {err}") from None
    return parse_recipe(data, source)


def list_recipes(recipes_dir: Path = RECIPES_DIR) -> list[str]:
    """Names of the recipes that ship in `recipes_dir`."""
    return sorted(p.stem for p in recipes_dir.glob("*.yaml"))


def load_recipe(name_or_path: str | Path, recipes_dir: Path = RECIPES_DIR) -> Recipe:
    """Load a recipe by name (from `recipes_dir`) or from a YAML file path."""
    text_name = str(name_or_path)
    if isinstance(name_or_path, Path) or "/" in text_name or text_name.endswith(".yaml"):
        path = Path(name_or_path)
        if not path.is_file():
            raise RecipeError(f"recipe file not found: {path}")
        recipe = parse_recipe_text(path.read_text(encoding="utf-8"), str(path))
        recipe.runtime.check_lock(path.resolve().parent)
        return recipe
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{0,47}", text_name):
        raise RecipeError(f"invalid recipe name {text_name!r}")
    path = recipes_dir / f"{text_name}.yaml"
    if not path.is_file():
        known = ", ".join(list_recipes(recipes_dir)) or "none"
        raise RecipeError(f"unknown recipe {text_name!r} (known: {known})")
    recipe = parse_recipe_text(path.read_text(encoding="utf-8"), str(path))
    if recipe.name != text_name:
        raise RecipeError(f"invalid recipe {path}: name: must be {text_name!r} (the file's name)")
    recipe.runtime.check_lock(recipes_dir)
    return recipe
