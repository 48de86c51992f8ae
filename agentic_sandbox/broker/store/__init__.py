"""Persistence: SQLAlchemy models, the async Database and its Alembic migrations."""

from agentic_sandbox.broker.store import models
from agentic_sandbox.broker.store.db import Database, Fenced

__all__ = ["Database", "Fenced", "models"]
