"""versioned loadouts: loadout versions, the active pointer, instances' exact version

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import agentic_sandbox.broker.store.models

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "loadout_versions",
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("version", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("document", sa.JSON(), nullable=False),
        sa.Column("resolved", sa.JSON(), nullable=False),
        sa.Column("extends_name", sa.String(length=63), nullable=True),
        sa.Column("extends_version", sa.Integer(), nullable=True),
        sa.Column("created_by", sa.String(length=128), nullable=False),
        sa.Column(
            "created_at",
            agentic_sandbox.broker.store.models.UTCDateTime(timezone=True),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["name"],
            ["loadouts.name"],
            name=op.f("fk_loadout_versions_name_loadouts"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("name", "version", name=op.f("pk_loadout_versions")),
        sa.UniqueConstraint("name", "digest", name=op.f("uq_loadout_versions_name")),
    )
    with op.batch_alter_table("instances", schema=None) as batch_op:
        batch_op.add_column(sa.Column("loadout_version", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("loadout_digest", sa.String(length=64), nullable=True))

    with op.batch_alter_table("loadouts", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("shared", sa.Boolean(), server_default=sa.false(), nullable=False)
        )
        batch_op.add_column(
            sa.Column("active_version", sa.Integer(), server_default="1", nullable=False)
        )
        batch_op.drop_column("spec")


def downgrade() -> None:
    with op.batch_alter_table("loadouts", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("spec", sa.JSON(), server_default=sa.text("'{}'"), nullable=False)
        )
        batch_op.drop_column("active_version")
        batch_op.drop_column("shared")

    with op.batch_alter_table("instances", schema=None) as batch_op:
        batch_op.drop_column("loadout_digest")
        batch_op.drop_column("loadout_version")

    op.drop_table("loadout_versions")
