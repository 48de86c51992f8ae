"""run budgets: a task run's budget, the budget it exceeded and what it used

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("budget", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("exceeded", sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column("cpu_us", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("peak_memory_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("peak_memory_bytes")
        batch_op.drop_column("cpu_us")
        batch_op.drop_column("exceeded")
        batch_op.drop_column("budget")
