"""Where the task service lives in the aiohttp application."""

from __future__ import annotations

from aiohttp import web

from agentic_sandbox.broker.tasks.service import TaskService

TASKS = web.AppKey("tasks", TaskService)
