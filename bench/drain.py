"""drain: how fast a backlog in PostgreSQL (or MariaDB) is drained into NATS JetStream.

    python -m bench.drain [--events 20000] [--repeat 3] [--workers 1 2]
                          [--brokers nats kafka rabbitmq redis servicebus]
                          [--database postgresql|mysql|both] [--output drain]

Each measurement stages a fresh backlog with the real write path (transactions of 100
events, 4 events per order id as stream key), then starts the relay and times the stream
from its first message to its last, as JetStream stamped them. It runs:

- ``router serve`` (one process, and ``--workers 2``), a subprocess with a generated config;
- a hand-written batched relay for comparison: raw asyncpg + nats-py, claim 500 rows with
  ``FOR UPDATE SKIP LOCKED``, publish them with acks in flight, mark them with one UPDATE.

Figures are medians over ``--repeat`` runs; each is also given as a ratio to the baseline.

On MariaDB (``--database mysql``, or ``both``: the two take turns variant by variant in every
round, each measurement on a fresh database of its own) the backlog is staged through a
SQLAlchemy connection, and the baseline is the same relay on asyncmy (``MYSQL_CLAIM``): the
oldest 500 open rows locked by primary key with ``SKIP LOCKED`` and leased in one short
transaction, published with acks in flight, marked with one UPDATE.

Then the same backlog is drained into every broker of ``--brokers`` (see ``bench._brokers``),
once per worker count, timed by the database's clock and counted at the broker: on
PostgreSQL only, against its baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import asyncpg
import nats

from bench import _mysql
from bench._brokers import KINDS, NOTES, drain_into, harnesses
from bench._common import (
    NATS_URL,
    RouterProcess,
    Stream,
    fresh_stream,
    median,
    order,
    print_table,
    router_config,
    wait_for_count,
    write_results,
)
from router import Outbox
from tests.conftest import make_config

PER_ORDER = 4
PER_TRANSACTION = 100

BASELINE_CLAIM = """
WITH picked AS (
    SELECT seq FROM router_outbox
    WHERE target = 'events' AND status IN ('pending', 'failed') AND available_at <= now()
    ORDER BY seq LIMIT $1
    FOR UPDATE SKIP LOCKED
)
UPDATE router_outbox AS o
SET status = 'processing', locked_until = now() + interval '30 seconds',
    attempts = o.attempts + 1
FROM picked WHERE o.seq = picked.seq
RETURNING o.seq, o.message_id::text, o.destination, o.envelope::text
"""
BASELINE_MARK = """
UPDATE router_outbox SET status = 'published', published_at = now(), locked_until = NULL
WHERE seq = ANY($1::bigint[])
"""

# BASELINE_CLAIM's twin on MariaDB, which has neither UPDATE ... RETURNING nor SKIP LOCKED
# outside a SELECT: the rows are picked and locked by one SELECT, leased by an UPDATE, in one
# transaction. The oldest open rows are read one status at a time in the order of
# ix_router_outbox_claim (target, status, seq) and not locked; the join then locks them by
# primary key and skips the ones another relay holds. (``status IN ('pending', 'failed')
# ORDER BY seq`` would sort every open row for each claim: 25 to 50 ms at 10,000 open rows,
# where this takes 3 to 6.)
MYSQL_OPEN = """
    (SELECT seq FROM router_outbox FORCE INDEX (ix_router_outbox_claim)
     WHERE target = 'events' AND status = '{status}' AND available_at <= UTC_TIMESTAMP(6)
     ORDER BY seq LIMIT %s)"""
MYSQL_CLAIM = f"""
SELECT o.seq, o.message_id, o.destination, o.envelope
FROM ({MYSQL_OPEN.format(status="pending")} UNION ALL {MYSQL_OPEN.format(status="failed")}
      ORDER BY seq LIMIT %s) AS picked
JOIN router_outbox AS o FORCE INDEX (PRIMARY) ON o.seq = picked.seq
WHERE o.status IN ('pending', 'failed') AND o.available_at <= UTC_TIMESTAMP(6)
ORDER BY o.seq
FOR UPDATE SKIP LOCKED
"""
MYSQL_LEASE = """
UPDATE router_outbox SET status = 'processing',
    locked_until = UTC_TIMESTAMP(6) + INTERVAL 30 SECOND, attempts = attempts + 1
WHERE seq IN ({seqs})
"""
MYSQL_MARK = """
UPDATE router_outbox SET status = 'published', published_at = UTC_TIMESTAMP(6),
    locked_until = NULL
WHERE seq IN ({seqs})
"""


async def stage_backlog(
    url: str, stream: Stream, events: int, brokers: dict[str, Any] | None = None
) -> None:
    """``events`` events through Outbox.stage, as an application would have written them."""
    internal = {
        "type": "nats",
        "internal": True,
        "destination": stream.destination,
        "stream": {"name": stream.name, "subjects": [stream.subject + ".>"]},
    }
    outbox = Outbox(make_config({"main": url}, brokers or {"events": internal}))
    async with transactions(outbox, url) as transaction:
        for start in range(0, events, PER_TRANSACTION):
            async with transaction() as conn:
                for first in range(start, min(start + PER_TRANSACTION, events), PER_ORDER):
                    await outbox.stage(
                        conn,
                        *(order(i) for i in range(first, min(first + PER_ORDER, events))),
                        stream_key=f"order-{first // PER_ORDER}",
                    )


@contextlib.asynccontextmanager
async def transactions(
    outbox: Outbox, url: str
) -> AsyncIterator[Callable[[], contextlib.AbstractAsyncContextManager[Any]]]:
    """What opens a producer's transactions: a raw asyncpg connection's on PostgreSQL, a
    SQLAlchemy engine's on MariaDB (each yields what ``stage()`` takes)."""
    if url.startswith("mysql"):
        try:
            yield outbox.engine().begin
        finally:
            await outbox.close()
        return
    conn = await asyncpg.connect(url)

    @contextlib.asynccontextmanager
    async def transaction() -> AsyncIterator[Any]:
        async with conn.transaction():
            yield conn

    try:
        yield transaction
    finally:
        await conn.close()


async def run_router(kind: str, events: int, workers: int) -> float:
    """Events/s of ``router serve --workers N`` draining a fresh backlog."""
    async with _mysql.fresh_database(kind, "drain") as url, fresh_stream("drain") as stream:
        await stage_backlog(url, stream, events)
        config = router_config(url, stream, batch_size=500)
        with RouterProcess(config, "--workers", str(workers)):
            first, last = await wait_for_count(stream, events)
        return events / (last - first) if last > first else float("inf")


async def run_baseline(kind: str, events: int, batch: int = 500) -> float:
    """Events/s of the hand-written relay on an identical backlog."""
    async with _mysql.fresh_database(kind, "base") as url, fresh_stream("base") as stream:
        await stage_backlog(url, stream, events)
        timing = asyncio.create_task(wait_for_count(stream, events))
        await (baseline_relay_mysql if kind == "mysql" else baseline_relay)(url, batch)
        first, last = await timing
        return events / (last - first) if last > first else float("inf")


async def baseline_relay(url: str, batch: int) -> None:
    """Claim, publish with acks in flight, mark; until the outbox is empty."""
    conn = await asyncpg.connect(url)
    client = await nats.connect(NATS_URL)
    js = client.jetstream(publish_async_max_pending=batch * 2)
    try:
        while True:
            rows = await conn.fetch(BASELINE_CLAIM, batch)
            if not rows:
                return
            futures = [
                await js.publish_async(r[2], r[3].encode(), headers={"Nats-Msg-Id": r[1]})
                for r in rows
            ]
            await asyncio.gather(*futures)
            await conn.execute(BASELINE_MARK, [r[0] for r in rows])
    finally:
        await client.close()
        await conn.close()


async def baseline_relay_mysql(url: str, batch: int) -> None:
    """``baseline_relay`` on MariaDB, with asyncmy: claim (``MYSQL_CLAIM``) and lease in one
    transaction, publish with acks in flight, mark; until the outbox is empty."""
    conn = await _mysql.connect(url, autocommit=True)
    client = await nats.connect(NATS_URL)
    js = client.jetstream(publish_async_max_pending=batch * 2)
    try:
        async with conn.cursor() as cursor:
            # As the router's store: no gap locks, so a claim never holds up an insert.
            await cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
            while True:
                await conn.begin()
                await cursor.execute(MYSQL_CLAIM, [batch, batch, batch])
                rows = await cursor.fetchall()
                if not rows:
                    await conn.commit()
                    return
                seqs = [r[0] for r in rows]
                marks = ", ".join(["%s"] * len(seqs))
                await cursor.execute(MYSQL_LEASE.format(seqs=marks), seqs)
                await conn.commit()
                futures = [
                    await js.publish_async(r[2], r[3].encode(), headers={"Nats-Msg-Id": r[1]})
                    for r in rows
                ]
                await asyncio.gather(*futures)
                await cursor.execute(MYSQL_MARK.format(seqs=marks), seqs)
    finally:
        await client.close()
        await conn.ensure_closed()


async def drain_per_broker(
    events: int, workers: list[int], kinds: list[str], baseline: float
) -> dict[str, Any]:
    """Drain the backlog into each broker kind; print a table; return the figures."""
    if not kinds:
        return {}

    async def stage(url: str, brokers: dict[str, Any], count: int) -> None:
        await stage_backlog(url, Stream("unused", "unused"), count, brokers)

    figures: dict[str, Any] = {}
    rows = []
    async with harnesses(kinds) as makers:
        for kind, make in makers.items():
            figures[kind] = {"broker": NOTES[kind]}
            for count in workers:
                result = await drain_into(make(), events, count, stage)
                result["ratio_to_baseline"] = round(result["events_per_second"] / baseline, 3)
                figures[kind][f"workers {count}"] = result
                rows.append(
                    (
                        kind,
                        count,
                        f"{result['events_per_second']:,}",
                        f"{result['ratio_to_baseline']:.2f}x",
                        f"{result['arrived']:,}",
                        NOTES[kind],
                    )
                )
                print(f"{kind} --workers {count}: {result['events_per_second']:,}/s", flush=True)
    print_table(
        f"drain per broker: {events:,} events, first claim to last mark (database clock, "
        "connecting to the broker included)",
        ["broker", "workers", "events/s", "vs baseline", "arrived", "peer"],
        rows,
    )
    return figures


Runs = dict[str, list[float]]
"""Events/s of each run, by relay."""


async def measure(
    kinds: Sequence[str], names: dict[str, str], events: int, repeat: int, workers: list[int]
) -> dict[str, Runs]:
    """Every relay ``repeat`` times on each database, the databases taking turns relay by
    relay; prints each round as it ends."""
    relays = ["baseline", *(f"router serve --workers {count}" for count in workers)]
    runs: dict[str, Runs] = {kind: {relay: [] for relay in relays} for kind in kinds}
    for round_ in range(repeat):
        for relay, count in zip(relays, [0, *workers], strict=True):
            for kind in kinds:
                rate = await (
                    run_router(kind, events, count) if count else run_baseline(kind, events)
                )
                runs[kind][relay].append(rate)
        print(
            f"round {round_ + 1}/{repeat}: "
            + "; ".join(
                (f"{names[kind]}: " if len(kinds) > 1 else "")
                + ", ".join(f"{relay} {values[-1]:,.0f}/s" for relay, values in runs[kind].items())
                for kind in kinds
            ),
            flush=True,
        )
    return runs


def summarise(runs: Runs) -> dict[str, Any]:
    """Each relay's median, its runs and its ratio to the baseline."""
    baseline = median(runs["baseline"])
    return {
        relay: {
            "events_per_second": round(median(values)),
            "runs": [round(v) for v in values],
            "ratio_to_baseline": round(median(values) / baseline, 3),
        }
        for relay, values in runs.items()
    }


def print_drain_table(
    events: int, repeat: int, names: dict[str, str], figures: dict[str, dict[str, Any]]
) -> None:
    """One row per relay; with two databases, side by side and MariaDB's rate over
    PostgreSQL's."""
    header = ["relay"]
    for kind in figures:
        named = f"{names[kind]} " if len(figures) > 1 else ""
        header += [f"{named}events/s", "vs baseline", "runs"]
    if len(figures) > 1:
        header.append(f"{names['mysql']} / {names['postgresql']}")
    rows = []
    for relay in next(iter(figures.values())):
        row = [relay]
        for kind_figures in figures.values():
            figure = kind_figures[relay]
            row += [
                f"{figure['events_per_second']:,}",
                f"{figure['ratio_to_baseline']:.2f}x",
                " ".join(f"{v:,}" for v in figure["runs"]),
            ]
        if len(figures) > 1:
            row.append(f"{across(figures, relay):.2f}x")
        rows.append(row)
    print_table(
        f"drain: {events:,} events from {' and '.join(names[k] for k in figures)} into "
        f"JetStream (median of {repeat})",
        header,
        rows,
    )


def across(figures: dict[str, dict[str, Any]], relay: str) -> float:
    """MariaDB's median rate of a relay over PostgreSQL's."""
    rates = {kind: figures[kind][relay]["events_per_second"] for kind in ("mysql", "postgresql")}
    return float(rates["mysql"] / rates["postgresql"])


async def main() -> None:
    """Run every variant ``--repeat`` times; print and save the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--brokers", nargs="*", choices=KINDS, default=list(KINDS))
    _mysql.add_database_option(parser)
    parser.add_argument("--output", default="drain", help="bench/results/OUTPUT.json")
    args = parser.parse_args()
    kinds = _mysql.chosen(args.database)
    parameters: dict[str, Any] = {
        "events": args.events,
        "repeat": args.repeat,
        "events_per_order": PER_ORDER,
        "events_per_transaction": PER_TRANSACTION,
        "batch_size": 500,
        "database": args.database,
    }
    names = {"postgresql": "PostgreSQL"}
    if "mysql" in kinds:
        parameters["mysql_server"] = await _mysql.server_settings()
        names["mysql"] = _mysql.server_name(parameters["mysql_server"]["version"])

    runs = await measure(kinds, names, args.events, args.repeat, args.workers)
    figures = {kind: summarise(runs[kind]) for kind in kinds}
    print_drain_table(args.events, args.repeat, names, figures)
    per_broker: dict[str, Any] = {}
    if "postgresql" in kinds:
        baseline = median(runs["postgresql"]["baseline"])
        per_broker = await drain_per_broker(args.events, args.workers, args.brokers, baseline)
    elif args.brokers:
        print("drain per broker: on PostgreSQL only (--database postgresql or both)")
    if len(kinds) == 1:
        results: dict[str, Any] = dict(figures[kinds[0]])
    else:
        results = {
            **figures,
            "mysql_vs_postgresql": {
                relay: round(across(figures, relay), 3) for relay in runs["mysql"]
            },
        }
    path = write_results(args.output, parameters, {**results, "per_broker": per_broker})
    print(f"written to {path.relative_to(path.parents[2])}")


if __name__ == "__main__":
    asyncio.run(main())
