"""Persistence: SQLAlchemy models, the async Database and its Alembic migrations."""

from broker.store import models
from broker.store.db import Database

__all__ = ["Database", "models"]
