"""xmin_hold: a transaction pins the xmin horizon during a long sustained run.

    python -m bench.xmin_hold [--minutes 30] [--hold-from 5] [--hold-minutes 10]
                              [--rate 1000] [--connections 4] [--per-transaction 5]
                              [--probe-every 3] [--probe-events 20000]

While any transaction of the database keeps an old snapshot, VACUUM removes no dead row
version: every delivered row leaves one in the outbox. This run shows what that costs the
router, whose queue slots are truncated instead (migration 0011).

One ``router serve --workers 1`` (the default config: retention, vacuum) delivers to a fresh
file stream while ``--connections`` producers commit ``--rate`` events/s steadily,
``--per-transaction`` per transaction, for ``--minutes``. From minute ``--hold-from`` a
session holds a repeatable-read transaction open (it read ``router_audit``, so it pins the
horizon and locks no outbox table) for ``--hold-minutes``.

Every ``--probe-every`` minutes a backlog of ``--probe-events`` events (``--per-transaction``
per stream key) is committed in one transaction on top of the steady load: the drain rate is
every message stored from its commit to its last message stored, over that time. Steady
events committed while a probe drains wait behind it; the per-minute p99 leaves them out
(``p99_ms``) and also shows all (``p99_all_ms``).
The loss is the median probe rate during the hold against the median outside it.

Every 10 s the run samples the outbox's dead tuples (``n_dead_tup`` of the history and of the
queue slots), the queue's size on disk, the horizon's age, and, every minute, whether the
claim is index-served (the plan ``router check`` reads). Latency is commit to stored
(JetStream's own timestamp), read back after the router stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import asyncpg
import nats
import uvloop
from nats.js.api import StorageType

from bench._common import (
    NATS_URL,
    RouterProcess,
    fresh_database,
    fresh_stream,
    median,
    order,
    print_table,
    router_config,
    write_results,
)
from bench._sustained_run import Plan, read_stored, wait_for_tail, warm_up
from bench._sustained_run import Trace as SustainedTrace
from bench._sustained_run import produce as produce_steadily
from bench.sustained import percentile
from router import Outbox
from router.ops.pg_health import claim_plan_problem
from router.relay.store.postgres_sql import RING_SLOTS
from tests.conftest import make_config

QUEUE = [f"router_outbox_q{slot}" for slot in range(RING_SLOTS)]
SAMPLE = """
SELECT coalesce(sum(n_dead_tup) FILTER (WHERE relname = ANY($1::text[])), 0)::bigint,
       coalesce(sum(n_dead_tup) FILTER (WHERE relname = 'router_outbox_done'), 0)::bigint,
       (SELECT sum(pg_total_relation_size(c))::bigint FROM unnest($1::regclass[]) AS c),
       pg_total_relation_size('router_outbox_done'),
       (SELECT max(age(backend_xmin)) FROM pg_stat_activity
        WHERE datname = current_database())
FROM pg_stat_user_tables WHERE relname LIKE 'router_outbox_%'
"""


@dataclass
class Sample:
    at: float  # seconds into the measured period
    queue_dead: int
    done_dead: int
    queue_bytes: int
    done_bytes: int
    xmin_age: int | None
    index_served: bool | None = None


@dataclass
class Probe:
    at: float
    first_commit: float = 0.0  # when the backlog's transaction committed
    ids: list[str] = field(default_factory=list)
    rate: float = 0.0
    seconds: float = 0.0


@dataclass
class Run:
    samples: list[Sample] = field(default_factory=list)
    probes: list[Probe] = field(default_factory=list)
    hold: tuple[float, float] = (0.0, 0.0)  # seconds into the period
    steady: SustainedTrace = field(default_factory=SustainedTrace)
    stored: dict[str, float] = field(default_factory=dict)
    duplicates: int = 0
    router_exit: int | None = None


async def measure(args: argparse.Namespace) -> Run:
    run = Run()
    seconds = args.minutes * 60
    plan = Plan("multi", args.rate, seconds, args.connections, args.per_transaction)
    async with (
        fresh_database("xmin") as url,
        fresh_stream("xmin", StorageType.FILE) as stream,
    ):
        config = router_config(url, stream)
        outbox = Outbox(make_config({"main": url}, config["brokers"]))
        client = await nats.connect(NATS_URL)
        producers = [await asyncpg.connect(url) for _ in range(args.connections)]
        prober, holder, monitor = [await asyncpg.connect(url) for _ in range(3)]
        try:
            with RouterProcess(config, "--workers", "1") as router:
                await warm_up(outbox, producers[0], client, {"events": stream}, router)
                steady = asyncio.create_task(produce_steadily(outbox, producers, plan, run.steady))
                await asyncio.sleep(0.1)  # produce() sets the period's start
                start = run.steady.started
                tasks = [
                    asyncio.create_task(sample(monitor, run, start)),
                    asyncio.create_task(hold(holder, run, start, args)),
                    asyncio.create_task(probe(prober, outbox, run, start, args)),
                ]
                try:
                    await steady
                    expected = len(run.steady.committed) + 1 + sum(len(p.ids) for p in run.probes)
                    await wait_for_tail(client, {"events": stream}, expected, run.steady, router)
                finally:
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                run.router_exit = router.process.poll()
            run.stored, run.duplicates = await read_stored(client, stream)
        finally:
            for conn in (*producers, prober, holder, monitor):
                await conn.close()
            await client.close()
    return run


async def sample(conn: asyncpg.Connection, run: Run, start: float) -> None:
    """Every 10 s, each query a transaction of its own (the monitor pins nothing)."""
    tick = 0
    while True:
        tick += 1
        await asyncio.sleep(max(0.0, start + tick * 10 - time.time()))
        row = await conn.fetchrow(SAMPLE, QUEUE)
        assert row is not None
        point = Sample(round(time.time() - start, 1), *row)
        if tick % 6 == 0:
            point.index_served = await claim_plan_problem(conn, "events") is None
        run.samples.append(point)


async def hold(conn: asyncpg.Connection, run: Run, start: float, args: argparse.Namespace) -> None:
    await asyncio.sleep(max(0.0, start + args.hold_from * 60 - time.time()))
    await conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    await conn.fetchval("SELECT count(*) FROM router_audit")
    began = time.time()
    try:
        await asyncio.sleep(args.hold_minutes * 60)
    finally:
        run.hold = (round(began - start, 1), round(time.time() - start, 1))
        with contextlib.suppress(Exception):
            await conn.execute("COMMIT")


async def probe(
    conn: asyncpg.Connection, outbox: Outbox, run: Run, start: float, args: argparse.Namespace
) -> None:
    n = 0
    while True:
        n += 1
        at = start + n * args.probe_every * 60 - 30  # off the minute: away from the hold's edges
        if at - start > args.minutes * 60 - 60:
            return
        await asyncio.sleep(max(0.0, at - time.time()))
        point = Probe(round(at - start, 1))
        # One transaction: the whole backlog becomes visible at its commit. Its events come
        # in aggregates of --per-transaction, one stream key each, as the steady load's do.
        size = args.per_transaction
        async with conn.transaction():
            for first in range(0, args.probe_events, size):
                events = [order(10_000_000 * n + i) for i in range(first, first + size)]
                point.ids += await outbox.stage(conn, *events, stream_key=f"probe-{n}-{first}")
        point.first_commit = time.time()
        run.probes.append(point)


def rates(run: Run) -> None:
    """Each probe's drain rate: messages stored from its first commit to its last stored."""
    times = sorted(run.stored.values())
    for point in run.probes:
        done = [run.stored[i] for i in point.ids if i in run.stored]
        if len(done) < len(point.ids):
            continue
        end = max(done)
        point.seconds = end - point.first_commit
        stored = sum(1 for t in times if point.first_commit <= t <= end)
        point.rate = stored / point.seconds if point.seconds > 0 else 0.0


def report(run: Run, args: argparse.Namespace) -> dict[str, Any]:
    rates(run)
    start = run.steady.started
    latency: dict[int, list[float]] = {}
    quiet: dict[int, list[float]] = {}  # committed while no probe was draining
    draining = [(p.first_commit, p.first_commit + p.seconds) for p in run.probes]
    missing: dict[int, int] = {}
    for message_id, committed in run.steady.committed.items():
        minute = int((committed - start) // 60)
        if message_id in run.stored:
            ms = (run.stored[message_id] - committed) * 1000
            latency.setdefault(minute, []).append(ms)
            if not any(lo <= committed <= hi for lo, hi in draining):
                quiet.setdefault(minute, []).append(ms)
        else:
            missing[minute] = missing.get(minute, 0) + 1
    minutes: list[dict[str, Any]] = []
    for minute in range(int(args.minutes)):
        lat = sorted(latency.get(minute, []))
        points = [s for s in run.samples if minute * 60 < s.at <= minute * 60 + 60]
        served = [s.index_served for s in points if s.index_served is not None]
        minutes.append(
            {
                "minute": minute + 1,
                "holding": run.hold[0] < minute * 60 + 60 and run.hold[1] > minute * 60,
                "committed": len(lat) + missing.get(minute, 0),
                "missing": missing.get(minute, 0),
                "p99_ms": round(percentile(sorted(quiet.get(minute, [])), 99), 1),
                "p99_all_ms": round(percentile(lat, 99), 1),
                "queue_dead": max((s.queue_dead for s in points), default=0),
                "done_dead": max((s.done_dead for s in points), default=0),
                "queue_mb": round(max((s.queue_bytes for s in points), default=0) / 2**20, 1),
                "xmin_age": max((s.xmin_age or 0 for s in points), default=0),
                "index_served": all(served) if served else None,
            }
        )
    inside = [p.rate for p in run.probes if p.rate and run.hold[0] <= p.at <= run.hold[1]]
    outside = [p.rate for p in run.probes if p.rate and not run.hold[0] <= p.at <= run.hold[1]]
    summary = {
        "drain_per_s_outside_hold": round(median(outside)) if outside else None,
        "drain_per_s_during_hold": round(median(inside)) if inside else None,
        "loss_pct": round(100 * (1 - median(inside) / median(outside)), 1)
        if inside and outside
        else None,
        "queue_dead_max": max((s.queue_dead for s in run.samples), default=0),
        "done_dead_max": max((s.done_dead for s in run.samples), default=0),
        "queue_mb_max": round(max((s.queue_bytes for s in run.samples), default=0) / 2**20, 1),
        "always_index_served": all(
            s.index_served for s in run.samples if s.index_served is not None
        ),
        "delivered": sum(1 for i in run.steady.committed if i in run.stored),
        "committed": len(run.steady.committed),
        "duplicates": run.duplicates,
        "router_exit": run.router_exit,
    }
    return {
        "minutes": minutes,
        "probes": [_probe(p, run.hold) for p in run.probes],
        "summary": summary,
        "hold_s": run.hold,
        "samples": [asdict(s) for s in run.samples],
    }


def _probe(point: Probe, hold: tuple[float, float]) -> dict[str, Any]:
    return {
        "at_s": point.at,
        "holding": hold[0] <= point.at <= hold[1],
        "events": len(point.ids),
        "seconds": round(point.seconds, 2),
        "drain_per_s": round(point.rate),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--hold-from", type=float, default=5)
    parser.add_argument("--hold-minutes", type=float, default=10)
    parser.add_argument("--rate", type=float, default=1000)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--per-transaction", type=int, default=5)
    parser.add_argument("--probe-every", type=float, default=3)
    parser.add_argument("--probe-events", type=int, default=20_000)
    args = parser.parse_args()
    run = uvloop.run(measure(args))
    figures = report(run, args)
    columns = ["minute", "holding", "committed", "missing", "p99_ms", "p99_all_ms", "queue_dead"]
    columns += ["done_dead"]
    columns += ["queue_mb", "xmin_age", "index_served"]
    print_table("per minute", columns, [[m[c] for c in columns] for m in figures["minutes"]])
    probe_columns = ["at_s", "holding", "events", "seconds", "drain_per_s"]
    print_table(
        "drain probes", probe_columns, [[p[c] for c in probe_columns] for p in figures["probes"]]
    )
    summary = figures["summary"]
    print_table("summary", list(summary), [list(summary.values())])
    write_results("xmin_hold", vars(args), figures)


if __name__ == "__main__":
    main()
