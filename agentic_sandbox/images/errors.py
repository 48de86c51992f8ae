"""Errors raised by the image builder and the image store."""

from __future__ import annotations


class ImageError(Exception):
    """Base class for every error of the `images` package."""


class RecipeError(ImageError):
    """A recipe could not be found, parsed or validated. The message names the bad field."""


class ImageNotFound(ImageError):
    """No complete image of that name exists in the cache."""


class InvalidImage(ImageError):
    """A file offered as an image (for example a user's cloud image) is not usable."""


class BuildError(ImageError):
    """A build step failed. `stage` names the step, `log_path` points at the build log."""

    def __init__(self, stage: str, message: str, log_path: str | None = None) -> None:
        self.stage = stage
        self.detail = message
        self.log_path = log_path
        text = f"{stage}: {message}"
        if log_path:
            text += f" (build log: {log_path})"
        super().__init__(text)


class BuildCancelled(ImageError):
    """The build was cancelled; its subprocesses were killed and its temp dir removed."""
