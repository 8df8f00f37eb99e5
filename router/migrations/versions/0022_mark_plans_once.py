"""PostgreSQL: ``router_mark()`` plans its statements once a session, not on every call.

PL/pgSQL plans a function's statement for the values of its first five calls, then keeps a
generic plan only if it does not cost more than those. The mark runs under
``enable_nestloop = off`` and ``enable_seqscan = off`` (0009, 0010), which price the generic
plans of its UPDATEs of the partitioned queue above the custom ones, so every call planned
each UPDATE it ran again: for a batch of one row, about 240 us of the server's time a call,
of which planning was most. With ``plan_cache_mode = force_generic_plan`` for the function,
about 100 us: the generic plan prunes the queue's slots when it starts and finds the rows by
seq, as the custom plans do. A batch of 500 rows costs the same either way (3 ms).
``bench.mark_cost`` measures both; a relay following a trickle marks a batch of one or two
rows per event.

One statement had to change for the generic plan: the closing of the gaps a published row
named (0016) tested each gap row against ``p_reported_ids::uuid[]``, a cast a custom plan
folds into a constant once and a generic plan evaluates again for every row. A row that
named a gap of 5,000 abandoned rows made its mark take 10 s instead of 8 ms. The ids are now
cast once, unnested and hashed.

MySQL/MariaDB and SQLite: nothing (their marks are statements the router sends).

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-29
"""

from __future__ import annotations

from alembic import op

from router.migrations.history import earlier

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

# 0017's mark with the two changes this revision is about. Both texts are history (0017's
# never changes), so the mark installed is fixed too.
CHANGES = (
    (
        """SET enable_seqscan = off
AS $$""",
        """SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan
AS $$""",
    ),
    (
        """        DELETE FROM router_gaps g
        WHERE g.target = p_target AND g.stream_key = ANY(p_reported_keys)
          AND g.message_id = ANY(p_reported_ids::uuid[]);
""",
        """        DELETE FROM router_gaps g
        USING unnest(p_reported_ids::uuid[]) AS r(message_id)
        WHERE g.target = p_target AND g.stream_key = ANY(p_reported_keys)
          AND g.message_id = r.message_id;
""",
    ),
)


def _previous() -> str:
    text: str = earlier("0017_held_and_parked.py").MARK_FUNCTION
    return text


def mark_function() -> str:
    """What this revision installs."""
    text = _previous()
    for before, after in CHANGES:
        assert text.count(before) == 1, f"0017's mark has {before.strip()!r} once"
        text = text.replace(before, after)
    return text


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(mark_function())


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    # CREATE OR REPLACE sets the function's settings anew: plan_cache_mode goes with it.
    op.execute(_previous())
