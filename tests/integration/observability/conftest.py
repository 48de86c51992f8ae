"""Fixtures: the in-process server."""

from tests.inproc import running

__all__ = ["running"]
