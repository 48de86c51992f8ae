"""host draining: a column instead of the `_draining` label

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_LABEL = "_draining"  # where hosts kept the flag before this revision

_hosts = sa.table(
    "hosts",
    sa.column("name", sa.String(63)),
    sa.column("labels", sa.JSON()),
    sa.column("draining", sa.Boolean()),
)


def upgrade() -> None:
    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("draining", sa.Boolean(), server_default=sa.false(), nullable=False)
        )
    conn = op.get_bind()
    for name, labels in conn.execute(sa.select(_hosts.c.name, _hosts.c.labels)).all():
        if not isinstance(labels, dict) or _LABEL not in labels:
            continue
        rest = {k: v for k, v in labels.items() if k != _LABEL}
        conn.execute(
            _hosts.update()
            .where(_hosts.c.name == name)
            .values(labels=rest, draining=bool(labels[_LABEL]))
        )


def downgrade() -> None:
    conn = op.get_bind()
    rows = conn.execute(
        sa.select(_hosts.c.name, _hosts.c.labels).where(_hosts.c.draining == sa.true())
    ).all()
    for name, labels in rows:
        kept = {**(labels if isinstance(labels, dict) else {}), _LABEL: True}
        conn.execute(_hosts.update().where(_hosts.c.name == name).values(labels=kept))
    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.drop_column("draining")
