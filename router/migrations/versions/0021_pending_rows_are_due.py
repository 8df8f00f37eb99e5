"""A pending row is due whatever its time: a stream's later rows never pass it.

The claim took a queued row when its ``available_at`` had come, pending or failed, and held a
stream back only behind a row in flight, failed, held or parked. A pending row whose time read
later than the claim's clock was therefore not taken, and held nothing back: the rows behind
it on its stream went first. That happens on PostgreSQL when a staging transaction that began
before a relay's run of batches commits during it (its rows carry its start time, later than
the run's ``now()``), and when an operator's release or requeue is stamped by a host whose
clock runs ahead of the server's. Now only a failed row waits for its time (and it holds its
stream back meanwhile); a pending row is due at once. Nothing else changes.

MySQL/MariaDB and SQLite: nothing (their claims are statements the router sends).

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-29
"""

from __future__ import annotations

from alembic import op

from router.migrations.history import earlier

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

# 0020's claim with its due test changed: the one clause this revision is about. Both texts
# are history (0020's never changes), so the claim installed is fixed too.
BEFORE = """          AND o.status IN ('pending', 'failed') AND o.available_at <= now()
"""
AFTER = """          AND o.status IN ('pending', 'failed')
          AND (o.status = 'pending' OR o.available_at <= now())
"""


def _previous() -> str:
    text: str = earlier("0020_claim_returns_xid.py").CLAIM_FUNCTION
    return text


def claim_function() -> str:
    """What this revision installs."""
    previous = _previous()
    assert previous.count(BEFORE) == 1, "0020's claim has the due test once"
    return previous.replace(BEFORE, AFTER)


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(claim_function())


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(_previous())
