"""What `router check` warns about on PostgreSQL: the outbox's two slow poisons.

- **A held xmin horizon.** While any transaction of the database keeps an old snapshot (an
  idle-in-transaction session, a long report, a prepared transaction, a replication slot),
  VACUUM cannot remove a single dead row version: every published row leaves its earlier
  versions and their index entries behind, and claims read past more of them each time.
- **A queue slot that cannot be truncated** (migration 0011): unfinished rows have kept a
  slot the new rows have left for longer than the horizon's limit, so the router does not
  truncate it, and its dead row versions wait for VACUUM.
- **A claim that is no longer index-served.** The claim must reach the queued rows through
  ``ix_router_outbox_claim`` and check streams in ``ix_router_outbox_stream``; any other plan
  costs time in proportion to the outbox's history (migration 0008 says how that happened).
  The check plans the claim's own query, as ``router_claim()`` runs it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from router._schema import IX_OUTBOX_CLAIM, IX_OUTBOX_STREAM, queue_slot, queue_slot_index
from router.relay.store.postgres_ring import held_slots
from router.relay.store.postgres_sql import CLAIM_FUNCTION

__all__ = [
    "CLAIM_QUERY",
    "claim_plan_problem",
    "explain_claim",
    "postgres_warnings",
    "xmin_holders",
]

# The claim's choice of rows, cut from the function's own text, with its arguments as
# parameters: $1 the target, $2 the batch size; planned as it runs while a stream is held
# back, the case that reads the stream index.
CLAIM_QUERY = (
    CLAIM_FUNCTION[CLAIM_FUNCTION.index("WITH picked AS (") + len("WITH picked AS (") :]
    .split("\n    )\n", 1)[0]
    .replace("p_target", "$1")
    .replace("p_limit", "$2")
    .replace("p_after", "0")  # the first batch of a transaction
    .replace("v_held_back", "true")
)

# The function's own planner settings (its SET clauses), for EXPLAIN.
_CLAIM_SETTINGS = tuple(
    f"SET LOCAL {line.removeprefix('SET ')}"
    for line in CLAIM_FUNCTION.splitlines()
    if line.startswith("SET ")
)

# Patterns of any queue slot's partition in a plan, and of its partitions of the claim's and
# the stream check's indexes.
_ANY_SLOT = queue_slot(r"\d")
_ANY_SLOT_CLAIM = queue_slot_index(IX_OUTBOX_CLAIM, r"\d")
_ANY_SLOT_STREAM = queue_slot_index(IX_OUTBOX_STREAM, r"\d")

HOLDERS = """
SELECT 'pid ' || pid || coalesce(' (' || nullif(application_name, '') || ')', '')
       || ', ' || coalesce(state, 'unknown state'),
       extract(epoch FROM now() - xact_start)::float8
FROM pg_stat_activity
WHERE datname = current_database() AND backend_xmin IS NOT NULL AND pid <> pg_backend_pid()
  AND xact_start < now() - make_interval(secs => $1)
UNION ALL
SELECT 'prepared transaction ' || quote_literal(gid), extract(epoch FROM now() - prepared)
FROM pg_prepared_xacts
WHERE database = current_database() AND prepared < now() - make_interval(secs => $1)
UNION ALL
SELECT 'replication slot ' || quote_literal(slot_name) || ' (xmin '
       || age(xmin) || ' transactions old)', NULL
FROM pg_replication_slots
WHERE xmin IS NOT NULL AND (database IS NULL OR database = current_database())
ORDER BY 2 DESC NULLS LAST
"""


async def xmin_holders(conn: Any, older_than: float) -> list[tuple[str, float | None]]:
    """Who has held the database's xmin horizon for more than ``older_than`` seconds: a
    description (never the query text, which may carry secrets) and for how long."""
    return [(r[0], r[1]) for r in await conn.fetch(HOLDERS, older_than)]


async def explain_claim(conn: Any, target: str, options: str = "") -> str:
    """The plan of a 500-row claim of ``target`` under the claim's own settings, with EXPLAIN
    ``options`` (``(ANALYZE, BUFFERS)`` runs it: it is rolled back either way)."""
    transaction = conn.transaction()
    await transaction.start()
    try:
        for setting in _CLAIM_SETTINGS:
            await conn.execute(setting)
        rows = await conn.fetch(f"EXPLAIN {options} {CLAIM_QUERY}", target, 500)
    finally:
        await transaction.rollback()
    return "\n".join(r[0] for r in rows)


async def claim_plan_problem(conn: Any, target: str) -> str | None:
    """None when the claim of ``target`` reads the indexes it should; else what it does."""
    plan = await explain_claim(conn, target)
    # Since 0011 the queue's slots are partitions, each scanned by its own index.
    expected = (
        rf"Index Scan using {_ANY_SLOT_CLAIM} on {_ANY_SLOT} o(_\d+)?\b",
        rf"Index Scan using {_ANY_SLOT_STREAM} on {_ANY_SLOT} p(_\d+)?\b",
    )
    if all(re.search(step, plan) for step in expected) and "Seq Scan" not in plan:
        return None
    scans = [line.strip() for line in plan.splitlines() if "Scan" in line]
    return "; ".join(scans) or plan.splitlines()[0]


async def postgres_warnings(
    dsn: str, targets: Sequence[str], *, xmin_limit: float = 300.0
) -> list[str]:
    """Every warning for one database, worded for the operator."""
    import asyncpg  # the relay's driver: only a PostgreSQL database needs it

    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        warnings = [
            f"xmin horizon held for {_age(age)} by {holder}: VACUUM can remove no dead row "
            "version until it ends; the outbox's finished queue slots are still truncated, "
            "but its history and any other table bloat"
            for holder, age in await xmin_holders(conn, xmin_limit)
        ]
        for slot in await held_slots(conn, xmin_limit):
            warnings.append(
                f"queue slot {queue_slot(slot.slot)} is not truncated: {slot.rows} row(s) "
                f"of {', '.join(map(repr, slot.targets))} unfinished there for {_age(slot.age)} "
                "(a paused target, or rows failing); its dead rows wait for VACUUM meanwhile"
            )
        for target in targets:
            problem = await claim_plan_problem(conn, target)
            if problem is not None:
                warnings.append(
                    f"the claim of target {target!r} is not index-served ({problem}); "
                    f"check that {IX_OUTBOX_CLAIM} and {IX_OUTBOX_STREAM} exist and "
                    f"are valid on every queue slot (`\\d {queue_slot(0)}` in psql)"
                )
        return warnings
    finally:
        await conn.close()


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "an unknown time"
    return f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f} s"
