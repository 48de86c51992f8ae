"""ImageBuilder: recipe -> cached guest image (debootstrap, customize, venv, ext4, qcow2)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from agentic_sandbox.images.disk import (
    allocated_bytes,
    convert_to_qcow2,
    filesystem_geometry,
    make_ext4,
    qemu_img_info,
    sha256_file,
)
from agentic_sandbox.images.errors import BuildCancelled, BuildError, ImageError
from agentic_sandbox.images.manifest import (
    MANIFEST_NAME,
    BootInfo,
    BuiltImage,
    DiskInfo,
    GuestInfo,
    Manifest,
)
from agentic_sandbox.images.mounts import mounted_proc, remove_tree, unmount_all
from agentic_sandbox.images.process import CommandRunner
from agentic_sandbox.images.progress import DebootstrapProgress, ProgressCallback, ProgressTracker
from agentic_sandbox.images.recipe import BUILDER_VERSION, Recipe, load_recipe
from agentic_sandbox.images.rootfs import (
    customize_tree,
    kernel_files,
    read_accounts,
    seal_tree,
    tree_usage,
)
from agentic_sandbox.images.runtime import CHROOT_ENV, ensure_wheelhouse, install_runtime
from agentic_sandbox.images.store import ImageStore

DISK_FILE = "disk.qcow2"
KERNEL_FILE = "vmlinuz"
INITRD_FILE = "initrd.img"
PACKAGES_FILE = "packages.txt"
LOG_FILE = "build.log"

_HOST_ENV_PASS = ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY")
_POLICY_RC_D = (
    "#!/bin/sh\n# agentic-sandbox image build: never start services in the chroot\nexit 101\n"
)


@dataclasses.dataclass(frozen=True)
class Tools:
    """Programs the builder runs (argv[0]s). Tests substitute fakes."""

    debootstrap: str = "debootstrap"
    mkfs: str = "mkfs.ext4"
    qemu_img: str = "qemu-img"
    chroot: str = "chroot"
    pip: tuple[str, ...] = (sys.executable, "-m", "pip")

    def missing(self) -> list[str]:
        path = CHROOT_ENV["PATH"] + os.pathsep + os.environ.get("PATH", "")
        names = [self.debootstrap, self.mkfs, self.qemu_img, self.chroot, self.pip[0]]
        return [n for n in names if shutil.which(n, path=path) is None]


@dataclasses.dataclass
class _Build:
    recipe: Recipe
    name: str
    tmp: Path
    runner: CommandRunner
    tracker: ProgressTracker
    cancel: threading.Event
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    sizes: dict[str, int] = dataclasses.field(default_factory=dict)
    facts: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def rootfs(self) -> Path:
        return self.tmp / "rootfs"


def _host_env() -> dict[str, str]:
    env = {"PATH": CHROOT_ENV["PATH"], "LANG": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive"}
    for key in _HOST_ENV_PASS:
        if key in os.environ:
            env[key] = os.environ[key]
    return env


class ImageBuilder:
    """Builds images from recipes into an ImageStore, reusing complete images.

    `build()` is synchronous and thread-safe; run it in a thread (or use `build_async`) from an
    event loop. A set `cancel` event kills the running subprocess group and removes the build's
    temp dir; BuildCancelled is raised.
    """

    def __init__(
        self,
        cache_dir: Path | str | None = None,
        *,
        tools: Tools | None = None,
        require_root: bool = True,
        debootstrap_timeout: float = 2400.0,
    ) -> None:
        self.store = ImageStore(cache_dir)
        self.tools = tools or Tools()
        self.require_root = require_root
        self.debootstrap_timeout = debootstrap_timeout

    # ---- public API ----------------------------------------------------------------------

    @staticmethod
    def resolve(recipe: str | Path | Recipe) -> Recipe:
        if isinstance(recipe, Recipe):
            return recipe
        return load_recipe(recipe)

    def image_name(self, recipe: str | Path | Recipe) -> str:
        """The name the recipe's image has (or will have) in the cache."""
        return self.resolve(recipe).image_name()

    def cached(self, recipe: str | Path | Recipe) -> BuiltImage | None:
        """The recipe's complete image if it is already in the cache, else None."""
        image = self.store.find(self.resolve(recipe).image_name())
        return dataclasses.replace(image, cached=True) if image else None

    def build(
        self,
        recipe: str | Path | Recipe,
        *,
        progress: ProgressCallback | None = None,
        cancel: threading.Event | None = None,
    ) -> BuiltImage:
        """Return the recipe's image, building it unless a complete one is cached.

        `progress` gets Progress(stage, fraction, message, ...) reports from the building thread.
        A complete image is never replaced (overlays may be using it as their backing file); to
        rebuild one, delete it first (ImageStore.delete).
        """
        r = self.resolve(recipe)
        name = r.image_name()
        tracker = ProgressTracker(progress)
        cancel = cancel if cancel is not None else threading.Event()
        hit = self.cached(r)
        if hit is not None:
            tracker.report("cached", 1.0, f"{name} is in the cache")
            return hit
        self._preflight()
        tracker.report("prepare", 0.0, f"building {name}")
        with self.store.lock(name, cancel):
            hit = self.cached(r)
            if hit is not None:  # another process built it while we waited
                tracker.report("cached", 1.0, f"{name} is in the cache")
                return hit
            self.store.clean_stale()
            if (self.store.image_dir(name) / MANIFEST_NAME).exists():
                # (a manifest-less leftover is replaced at publish time)
                try:
                    self.store.get(name)
                except ImageError as err:
                    raise ImageError(
                        f"{err}; delete it (python -m agentic_sandbox.images delete {name})"
                    ) from None
            with self.store.staging(name) as tmp:
                self._build_into(tmp, r, name, tracker, cancel)
                image = self.store.publish(tmp, name)
        total = image.manifest.timings.get("total", 0.0)
        tracker.report("done", 1.0, f"built {name} in {total:.0f} s")
        return image

    async def build_async(
        self,
        recipe: str | Path | Recipe,
        *,
        progress: ProgressCallback | None = None,
    ) -> BuiltImage:
        """`build()` in a worker thread. Cancelling the awaiting task cancels the build (and
        waits for its cleanup). `progress` is called on the event loop's thread."""
        loop = asyncio.get_running_loop()
        cancel = threading.Event()
        cb: ProgressCallback | None = None
        if progress is not None:
            user_cb = progress

            def cb(p: Any) -> None:
                loop.call_soon_threadsafe(user_cb, p)

        fut = loop.run_in_executor(None, lambda: self.build(recipe, progress=cb, cancel=cancel))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            cancel.set()
            with contextlib.suppress(BaseException):
                await fut
            raise

    def import_cloud_image(
        self,
        path: Path | str,
        *,
        name: str | None = None,
        progress: ProgressCallback | None = None,
        cancel: threading.Event | None = None,
        link: bool = False,
    ) -> BuiltImage:
        """Accept a user's cloud image (qcow2 with cloud-init). See images.cloud."""
        from agentic_sandbox.images.cloud import import_cloud_image

        return import_cloud_image(
            self.store,
            path,
            name=name,
            progress=progress,
            cancel=cancel,
            link=link,
            qemu_img=self.tools.qemu_img,
        )

    # ---- the build -----------------------------------------------------------------------

    def _preflight(self) -> None:
        if self.require_root and os.geteuid() != 0:
            raise ImageError("building an image needs root (debootstrap, chroot, mount /proc)")
        missing = self.tools.missing()
        if missing:
            raise ImageError(
                f"missing build tools: {', '.join(missing)} "
                "(apt-get install debootstrap e2fsprogs qemu-utils)"
            )

    def _build_into(
        self,
        tmp: Path,
        recipe: Recipe,
        name: str,
        tracker: ProgressTracker,
        cancel: threading.Event,
    ) -> None:
        log_path = tmp / LOG_FILE
        started = time.monotonic()
        with open(log_path, "w", encoding="utf-8") as log:
            runner = CommandRunner(log, cancel)
            b = _Build(recipe, name, tmp, runner, tracker, cancel)
            runner.write(
                f"# agentic-sandbox image build {name}\n# builder {BUILDER_VERSION}, "
                f"recipe hash {recipe.content_hash()}\n# started {_now()}"
            )
            stages: list[tuple[str, Callable[[_Build], None]]] = [
                ("wheels", self._stage_wheels),
                ("debootstrap", self._stage_debootstrap),
                ("customize", self._stage_customize),
                ("runtime", self._stage_runtime),
                ("inspect", self._stage_inspect),
                ("filesystem", self._stage_filesystem),
                ("convert", self._stage_convert),
            ]
            try:
                for stage, fn in stages:
                    runner.check_cancel()
                    t0 = time.monotonic()
                    tracker.report(stage, 0.0, f"{stage} started")
                    runner.write(f"\n## stage {stage}")
                    fn(b)
                    b.timings[stage] = round(time.monotonic() - t0, 2)
                    tracker.report(stage, 1.0, f"{stage} done in {b.timings[stage]:.1f} s")
                b.timings["total"] = round(time.monotonic() - started, 2)
                tracker.report("finalize", 0.0, "writing manifest")
                self._stage_finalize(b)
                runner.write(f"# finished {_now()} in {b.timings['total']:.1f} s")
            except (KeyboardInterrupt, BuildCancelled) as err:
                runner.write(f"# cancelled during {tracker.stage}")
                self._keep_log(log, name, "cancelled")
                if isinstance(err, KeyboardInterrupt):
                    raise
                raise BuildCancelled(f"build of {name} cancelled during {tracker.stage}") from None
            except BuildError as err:
                runner.write(f"# FAILED: {err}")
                saved = self._keep_log(log, name, "failed")
                raise BuildError(err.stage, err.detail, str(saved)) from None
            except (ImageError, OSError, ValueError) as err:
                runner.write(f"# FAILED: {err!r}")
                saved = self._keep_log(log, name, "failed")
                raise BuildError(tracker.stage, str(err), str(saved)) from None
            finally:
                # Nothing may stay mounted in the tree, whatever happened.
                with contextlib.suppress(ImageError):
                    unmount_all(tmp)

    def _keep_log(self, log: IO[str], name: str, what: str) -> Path:
        log.flush()
        self.store.logs_dir.mkdir(parents=True, exist_ok=True)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        dest = self.store.logs_dir / f"{name}.{stamp}.{what}.log"
        with contextlib.suppress(OSError):
            shutil.copyfile(log.name, dest)
            os.chmod(dest, 0o644)
        return dest

    def _stage_wheels(self, b: _Build) -> None:
        b.facts["wheelhouse"] = ensure_wheelhouse(
            b.runner, list(self.tools.pip), self.store.wheels_dir, b.recipe.runtime
        )

    def _stage_debootstrap(self, b: _Build) -> None:
        r = b.recipe
        self.store.debs_dir.mkdir(parents=True, exist_ok=True)
        argv = [self.tools.debootstrap]
        if r.variant != "default":
            argv.append(f"--variant={r.variant}")
        argv += [
            f"--arch={r.architecture}",
            f"--components={','.join(r.components)}",
            f"--include={','.join(r.all_packages())}",
            f"--cache-dir={self.store.debs_dir}",
            r.suite,
            str(b.rootfs),
            r.mirror,
        ]
        watcher = DebootstrapProgress(
            lambda f, msg: b.tracker.report("debootstrap", f, msg),
            expected_packages=max(150, 4 * len(r.all_packages())),
        )
        try:
            b.runner.run(
                argv,
                stage="debootstrap",
                env=_host_env(),
                timeout=self.debootstrap_timeout,
                on_line=watcher.feed,
            )
        finally:
            unmount_all(b.rootfs)

    def _stage_customize(self, b: _Build) -> None:
        root = b.rootfs
        policy = root / "usr/sbin/policy-rc.d"
        policy.write_text(_POLICY_RC_D)
        os.chmod(policy, 0o755)
        customize_tree(root, b.recipe)
        b.tracker.report("customize", 0.5, "files written")
        units = list(b.recipe.customize.enable_units)
        commands = b.recipe.customize.commands
        if not units and not commands:
            return
        with mounted_proc(root):
            if units:
                b.runner.run(
                    [self.tools.chroot, str(root), "systemctl", "enable", *units],
                    stage="customize",
                    env=CHROOT_ENV,
                    timeout=300,
                )
            for argv in commands:
                b.runner.run(
                    [self.tools.chroot, str(root), *argv],
                    stage="customize",
                    env=CHROOT_ENV,
                    timeout=1800,
                )

    def _stage_runtime(self, b: _Build) -> None:
        rt = b.recipe.runtime
        b.facts["agent_packages"] = install_runtime(
            b.runner, self.tools.chroot, b.rootfs, rt, b.facts["wheelhouse"]
        )

    def _stage_inspect(self, b: _Build) -> None:
        root = b.rootfs
        chroot = self.tools.chroot
        listing = b.runner.run(
            [chroot, str(root), "dpkg-query", "-W", "-f", "${Package}\t${Version}\n"],
            stage="inspect",
            env=CHROOT_ENV,
            capture=True,
            timeout=120,
        )
        packages = dict(line.split("\t", 1) for line in listing.splitlines() if "\t" in line)
        (b.tmp / PACKAGES_FILE).write_text(
            "".join(f"{k}\t{v}\n" for k, v in sorted(packages.items())), encoding="utf-8"
        )
        pyver = b.runner.run(
            [
                chroot,
                str(root),
                b.recipe.runtime.python,
                "-c",
                "import sys; print('%d.%d.%d' % sys.version_info[:3])",
            ],
            stage="inspect",
            env=CHROOT_ENV,
            capture=True,
            timeout=60,
        ).strip()
        vmlinuz, initrd, version = kernel_files(root)
        shutil.copyfile(vmlinuz, b.tmp / KERNEL_FILE)
        shutil.copyfile(initrd, b.tmp / INITRD_FILE)
        users, groups = read_accounts(root)
        b.facts.update(
            packages=packages,
            python_version=pyver,
            kernel_version=version,
            users=users,
            groups=groups,
        )
        b.sizes["kernel_bytes"] = (b.tmp / KERNEL_FILE).stat().st_size
        b.sizes["initrd_bytes"] = (b.tmp / INITRD_FILE).stat().st_size
        # Seal: no service-start blocker, no identity, no caches, empty resolv.conf.
        (root / "usr/sbin/policy-rc.d").unlink(missing_ok=True)
        seal_tree(root)

    def _stage_filesystem(self, b: _Build) -> None:
        content, inodes = tree_usage(b.rootfs)
        size, inode_count = filesystem_geometry(content, inodes, b.recipe.disk.free_space_mib)
        b.tracker.report(
            "filesystem",
            0.1,
            f"{content / 2**20:.0f} MiB in {inodes} inodes -> {size / 2**20:.0f} MiB ext4",
        )
        raw = b.tmp / "root.raw"
        final = make_ext4(
            b.runner,
            self.tools.mkfs,
            b.rootfs,
            raw,
            label=b.recipe.disk.root_label,
            size=size,
            inodes=inode_count,
        )
        b.sizes.update(rootfs_bytes=content, rootfs_inodes=inodes, filesystem_bytes=final)
        b.tracker.report("filesystem", 0.9, "removing the build tree")
        remove_tree(b.rootfs)

    def _stage_convert(self, b: _Build) -> None:
        raw = b.tmp / "root.raw"
        disk = b.tmp / DISK_FILE
        convert_to_qcow2(
            b.runner, self.tools.qemu_img, raw, disk, compression=b.recipe.disk.compression
        )
        raw.unlink()
        info = qemu_img_info(disk, self.tools.qemu_img)
        b.tracker.report("convert", 0.7, "hashing the disk")
        b.facts["disk_sha256"] = sha256_file(disk, b.cancel)
        b.facts["virtual_size"] = int(info.get("virtual-size", 0))
        b.sizes["qcow2_bytes"] = disk.stat().st_size
        b.sizes["qcow2_allocated_bytes"] = allocated_bytes(disk)

    def _stage_finalize(self, b: _Build) -> None:
        r = b.recipe
        pkgs: dict[str, str] = b.facts["packages"]
        manifest = Manifest(
            name=b.name,
            kind="built",
            recipe_name=r.name,
            recipe=r.model_dump(mode="json"),
            content_hash=r.content_hash(),
            builder_version=BUILDER_VERSION,
            created_at=_now(),
            disk=DiskInfo(
                file=DISK_FILE,
                format="qcow2",
                virtual_size=b.facts["virtual_size"],
                actual_size=b.sizes["qcow2_bytes"],
                compression=r.disk.compression,
                sha256=b.facts["disk_sha256"],
            ),
            boot=BootInfo(
                direct_kernel=True,
                kernel=KERNEL_FILE,
                initrd=INITRD_FILE,
                kernel_version=b.facts["kernel_version"],
                root_label=r.disk.root_label,
                cmdline=r.kernel_cmdline(),
            ),
            guest=GuestInfo(
                distribution=r.distribution,
                suite=r.suite,
                python=r.runtime.python,
                python_version=b.facts["python_version"],
                agent_venv=r.runtime.venv_path,
                agent_python=f"{r.runtime.venv_path}/bin/python",
                agent_packages=b.facts["agent_packages"],
                cloud_init_version=pkgs.get("cloud-init"),
                systemd_version=pkgs.get("systemd"),
                package_count=len(pkgs),
                users=b.facts["users"],
                groups=b.facts["groups"],
            ),
            agent_runtime_baked=True,
            sizes=b.sizes,
            timings=b.timings,
            source=r.mirror,
        )
        (b.tmp / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def build_image(
    recipe: str | Path | Recipe,
    cache_dir: Path | str | None = None,
    *,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
) -> BuiltImage:
    """Shorthand for `ImageBuilder(cache_dir).build(recipe, ...)`."""
    return ImageBuilder(cache_dir).build(recipe, progress=progress, cancel=cancel)
