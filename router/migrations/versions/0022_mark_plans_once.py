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

MySQL/MariaDB and SQLite: nothing (their marks are statements the router sends).

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-29
"""

from __future__ import annotations

from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

# router_mark's signature since 0017.
MARK = (
    "router_mark(bigint[], text[], bigint[], double precision[], text[], bigint[], text[],"
    " text, text[], text[], bigint[], text[], bigint[], text[])"
)


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(f"ALTER FUNCTION {MARK} SET plan_cache_mode = force_generic_plan")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(f"ALTER FUNCTION {MARK} RESET plan_cache_mode")
