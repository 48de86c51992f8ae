"""control hosts: the leader's term row and the nodes seen on this database

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import agentic_sandbox.broker.store.models

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    control_term = op.create_table(
        "control_term",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("term", sa.BigInteger(), nullable=False),
        sa.Column("leader_node", sa.String(length=63), nullable=True),
        sa.Column("leader_http_url", sa.String(length=2048), nullable=True),
        sa.Column("leader_grpc", sa.String(length=255), nullable=True),
        sa.Column(
            "since",
            agentic_sandbox.broker.store.models.UTCDateTime(timezone=True),
            nullable=True,
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_control_term")),
    )
    op.bulk_insert(control_term, [{"id": 1, "term": 0}])
    op.create_table(
        "control_nodes",
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("http_url", sa.String(length=2048), nullable=False),
        sa.Column("grpc_address", sa.String(length=255), nullable=False),
        sa.Column("version", sa.String(length=32), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column(
            "started_at",
            agentic_sandbox.broker.store.models.UTCDateTime(timezone=True),
            nullable=False,
        ),
        sa.Column(
            "seen_at",
            agentic_sandbox.broker.store.models.UTCDateTime(timezone=True),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_control_nodes")),
    )


def downgrade() -> None:
    op.drop_table("control_nodes")
    op.drop_table("control_term")
