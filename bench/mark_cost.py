"""mark_cost: what one claim and one mark cost PostgreSQL, by batch size.

    python -m bench.mark_cost [--batches 1,500] [--rounds 3] [--output mark-cost]

Each point: a fresh database migrated to head, a backlog of queued rows (one stream key
each), then transactions of ``router_claim()`` for a batch and ``router_mark()`` publishing
it, as a relay's batch runs, one connection. The server's time in each function per call
comes from ``pg_stat_user_functions`` (``track_functions = 'pl'`` in the session); the
transaction's wall time from the client. Ten batches go first, unmeasured: the steady state,
past PL/pgSQL's first five plans of each statement. Two marks, in interleaved rounds:

- ``generic``: the mark as migration 0022 installs it, each statement planned once for the
  session (``plan_cache_mode = force_generic_plan``);
- ``replanned``: the same function without that setting, as before 0022, where PL/pgSQL
  planned each UPDATE again on every call (0022's other change, to the closing of gaps, is
  in both: no batch here names a gap).

A relay following a trickle marks a batch of one or two rows per event, so the small batch
is what its database pays per event.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import asyncpg

from bench._common import fresh_database, print_table, write_results
from bench.write_concurrency import numbers, spread
from router._schema import FN_MARK
from router.relay.store.postgres import CLAIM, MARK

MODES = ("generic", "replanned")
_REPLANNED = f"ALTER FUNCTION {FN_MARK} RESET plan_cache_mode"  # its one signature
_BACKLOG = """
INSERT INTO router_outbox (message_id, target, destination, event_type, stream_key, envelope)
SELECT gen_random_uuid(), 'events', 'bench.order_placed', 'order_placed', 'order-' || i,
       '{"order_id": "x"}'
FROM generate_series(1, $1) AS i
"""
_SPENT = "SELECT funcname, calls, total_time FROM pg_stat_user_functions"


# Batches before the measured ones: PL/pgSQL plans a statement for its first five calls'
# values before it may keep a generic plan, and the claim's custom plans cost about 1.4 ms each
# (a relay's session pays them once); the steady state is what a running relay pays.
_WARM = 10


async def _batch(conn: asyncpg.Connection, batch: int) -> None:
    """One batch as a relay runs it: claim ``batch`` rows, mark them published, commit."""
    async with conn.transaction():
        seqs = [r[0] for r in await conn.fetch(CLAIM, "events", batch, "w", 30.0, True, 0)]
        assert len(seqs) == batch
        await conn.execute(MARK, seqs, None, [], [], [], [], [], "events", [], [], [], [], [], [])


async def point(mode: str, batch: int, calls: int) -> dict[str, float]:
    """us a call in each function, and a batch's transaction, for ``calls`` batches."""
    async with fresh_database("mark_cost") as url:
        conn = await asyncpg.connect(url)
        try:
            if mode == "replanned":
                await conn.execute(_REPLANNED)
            await conn.execute(_BACKLOG, batch * (_WARM + calls))
            await conn.execute("SET track_functions = 'pl'")
            for _ in range(_WARM):
                await _batch(conn, batch)
            await conn.execute("SELECT pg_stat_reset()")
            started = time.perf_counter()
            for _ in range(calls):
                await _batch(conn, batch)
            wall = (time.perf_counter() - started) / calls * 1e6
            # The session's function counts reach the view when it flushes them.
            await conn.execute("SELECT pg_stat_force_next_flush()")
        finally:
            await conn.close()
        reader = await asyncpg.connect(url)
        try:
            spent = {
                r["funcname"]: r["total_time"] * 1000 / r["calls"]
                for r in await reader.fetch(_SPENT)
            }
        finally:
            await reader.close()
    return {"claim_us": spent["router_claim"], "mark_us": spent["router_mark"], "batch_us": wall}


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every round: per batch size, each mode in turn (rotated by the round)."""
    runs: dict[tuple[int, str], list[dict[str, float]]] = {}
    for round_ in range(args.rounds):
        for batch in args.batches:
            calls = max(20, 1500 // batch)
            shift = round_ % len(MODES)
            for mode in MODES[shift:] + MODES[:shift]:
                figures = await point(mode, batch, calls)
                runs.setdefault((batch, mode), []).append(figures)
                print(f"  round {round_ + 1} batch {batch} {mode}: {figures}", flush=True)
    return {
        str(batch): {
            mode: {
                key: spread([run[key] for run in runs[(batch, mode)]], 1)
                for key in ("claim_us", "mark_us", "batch_us")
            }
            for mode in MODES
        }
        for batch in args.batches
    }


def main() -> None:
    """Measure, print, save."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=numbers, default=[1, 500])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", default="mark-cost", help="bench/results/OUTPUT.json")
    args = parser.parse_args()
    figures = asyncio.run(measure(args))

    def cell(value: dict[str, Any]) -> str:
        return f"{value['median']:,.0f} ({value['min']:,.0f}-{value['max']:,.0f})"

    print_table(
        f"mark_cost: us a call in the server, and a batch's transaction, median (lowest-highest)"
        f" of {args.rounds} rounds",
        ("batch", "mark", "router_mark", "router_claim", "transaction"),
        [
            (batch, mode, cell(m["mark_us"]), cell(m["claim_us"]), cell(m["batch_us"]))
            for batch, modes in figures.items()
            for mode, m in modes.items()
        ],
    )
    path = write_results(args.output, {"batches": args.batches, "rounds": args.rounds}, figures)
    print(f"written to {path}")


if __name__ == "__main__":
    main()
