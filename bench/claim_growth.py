"""claim_growth: does a claim get slower with every row the target has delivered?

    python -m bench.claim_growth [--rows 10000] [--window 1000]

What a router following a trickle does, without the broker: one connection stages one event
per transaction, claims it with ``router_claim()`` and marks it published, ``--rows`` times,
on a fresh outbox with no statistics and no VACUUM (autovacuum off for the table). Run twice
in turn: on the claim and indexes that ship (head: the partitioned outbox of 0011, its claim
and mark, each batch in one transaction), and on migration 0007's (the 0008 migration's own
downgrade statements, applied to a fresh 0010 database, with that era's lease claim and a
plain mark). Per
window of ``--window`` rows: the claim's median and p99 time as the client sees it, and the
claim's PostgreSQL buffer reads (pg_stat_statements is not needed: the backend's own counters).
"""

from __future__ import annotations

import argparse
import importlib
import time
from typing import Any

import asyncpg
import uvloop

from bench._common import fresh_database, order, print_table, write_results
from router import Outbox
from tests.conftest import make_config

CLAIM = "SELECT seq FROM router_claim('events', 100, 'w', 30, true, 0)"
MARK = (
    "SELECT router_mark($1, NULL, '{}', '{}', '{}', '{}', '{}', 'events', '{}', '{}',"
    " '{}', '{}', '{}', '{}')"
)
# 0007's claim leased the rows under a token, and its mark was fenced by it.
CLAIM_0007 = "SELECT seq FROM router_claim('events', 100, 'w', 30, $1, true)"
MARK_0007 = """
UPDATE router_outbox SET status = 'published', published_at = now(), locked_by = NULL,
    locked_until = NULL
WHERE seq = ANY($1) AND lease_token = $2 AND status = 'processing'
"""
LEAVES = """
SELECT c.oid::regclass::text FROM pg_class c
WHERE c.relkind = 'r' AND (c.relname = 'router_outbox' OR c.oid IN (
    SELECT relid FROM pg_partition_tree('router_outbox') WHERE isleaf))
"""
BLOCKS = "SELECT sum(heap_blks_hit + idx_blks_hit) FROM pg_statio_user_tables"

# The 0008 migration's downgrade, by its own texts: migration 0007's claim and indexes.
_M0008 = importlib.import_module("router.migrations.versions.0008_index_served_claims")
SCHEMA_0007 = [
    *(f"DROP INDEX ix_router_outbox_{name}" for name in ("claim", "stream", "due")),
    _M0008.DEFAULT_STATISTICS,
    *_M0008.PREVIOUS_INDEXES,
    _M0008.PREVIOUS_CLAIM_FUNCTION,
]


async def measure(schema: str, rows: int, window: int) -> list[dict[str, Any]]:
    """Stage, claim and mark ``rows`` events one at a time; figures per window."""
    # 0007's indexes are put back on 0010's plain table; the claim that ships runs on head's.
    async with fresh_database("growth", "0010" if schema == "0007" else "head") as url:
        outbox = Outbox(
            make_config({"main": url}, {"events": {"type": "memory", "internal": True}})
        )
        conn = await asyncpg.connect(url)
        try:
            # Storage parameters are each table's: the partitions' since 0011.
            for table in await conn.fetch(LEAVES):
                await conn.execute(f"ALTER TABLE {table[0]} SET (autovacuum_enabled = off)")
            if schema == "0007":
                for statement in SCHEMA_0007:
                    await conn.execute(statement)
            figures: list[dict[str, Any]] = []
            times: list[float] = []
            blocks = int(await conn.fetchval(BLOCKS) or 0)
            for i in range(rows):
                async with conn.transaction():
                    await outbox.stage(conn, order(i), stream_key=f"s-{i}")
                if schema == "0007":
                    started = time.perf_counter()
                    seqs = [r[0] for r in await conn.fetch(CLAIM_0007, i + 1)]
                    times.append((time.perf_counter() - started) * 1000)
                    await conn.execute(MARK_0007, seqs, i + 1)
                else:
                    async with conn.transaction():
                        started = time.perf_counter()
                        seqs = [r[0] for r in await conn.fetch(CLAIM)]
                        times.append((time.perf_counter() - started) * 1000)
                        await conn.execute(MARK, seqs)
                if len(times) == window:
                    times.sort()
                    # pg_statio counts reach the view at the end of each transaction.
                    now_blocks = int(await conn.fetchval(BLOCKS) or 0)
                    figures.append(
                        {
                            "rows": i + 1,
                            "claim_p50_ms": round(times[len(times) // 2], 3),
                            "claim_p99_ms": round(times[int(len(times) * 0.99) - 1], 3),
                            "blocks_per_row": round((now_blocks - blocks) / window, 1),
                        }
                    )
                    blocks, times = now_blocks, []
            return figures
        finally:
            await conn.close()
            await outbox.close()


async def main() -> None:
    """Both schemas, in turn; print and save."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--window", type=int, default=1_000)
    args = parser.parse_args()
    results = {schema: await measure(schema, args.rows, args.window) for schema in ("0007", "head")}
    header = ["rows delivered"]
    for schema in results:
        header += [f"{schema} p50 ms", f"{schema} p99 ms", f"{schema} blocks/row"]
    table = []
    for windows in zip(*results.values(), strict=True):
        row: list[object] = [f"{windows[0]['rows']:,}"]
        for w in windows:
            row += [w["claim_p50_ms"], w["claim_p99_ms"], w["blocks_per_row"]]
        table.append(row)
    print_table(
        f"claim_growth: stage 1 event, claim, mark, {args.rows:,} times on a fresh outbox "
        "(no statistics, no VACUUM); claim time as the client sees it, and buffers read per "
        "row (heap and index, staging and marking included)",
        header,
        table,
    )
    path = write_results("claim_growth", vars(args), results)
    print(f"written to {path.relative_to(path.parents[2])}")


if __name__ == "__main__":
    uvloop.run(main())
