"""The rows of one application transaction, found together: targets with ``atomic: true``.

An atomic target publishes the rows one transaction staged for it as one unit (one JetStream
batch, one Service Bus batch, one Redis ``MULTI``/``EXEC``). A claim takes rows in outbox
order up to its limit, which may cut a transaction's rows in two; the relay then claims the
rest of each transaction it holds a row of, by its ``xid`` (PostgreSQL has stored every row's
transaction id since 0001). This revision adds the index that lookup needs on each queue
slot, then on the queue (which attaches them, as 0011 made its indexes): the target and xid of
every row still open or set aside. A target without ``atomic`` never reads it; every row
pays one more index entry at insert and at its mark.

MySQL/MariaDB and SQLite: nothing yet (their stagers record no transaction; ``atomic`` is
refused for their databases at config time).

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-28
"""

from __future__ import annotations

from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

SLOTS = 8

# Open or set aside: every row whose unit the relay may still publish or hold back.
UNIT_ROWS = "status IN ('pending', 'failed', 'held', 'parked')"


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for slot in range(SLOTS):
        op.execute(
            f"CREATE INDEX ix_router_outbox_unit_q{slot} ON router_outbox_q{slot}"
            f" (target, xid) WHERE {UNIT_ROWS}"
        )
    op.execute(
        f"CREATE INDEX ix_router_outbox_unit ON router_outbox_queue (target, xid) WHERE {UNIT_ROWS}"
    )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP INDEX ix_router_outbox_unit")  # the queue's, with its slots'
