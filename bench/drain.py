"""drain: how fast a backlog in PostgreSQL is drained into NATS JetStream.

    python -m bench.drain [--events 20000] [--repeat 3] [--workers 1 2]
                          [--brokers nats kafka rabbitmq redis servicebus]

Each measurement stages a fresh backlog with the real write path (transactions of 100
events, 4 events per order id as stream key), then starts the relay and times the stream
from its first message to its last, as JetStream stamped them. It runs:

- ``router serve`` (one process, and ``--workers 2``), a subprocess with a generated config;
- a hand-written batched relay for comparison: raw asyncpg + nats-py, claim 500 rows with
  ``FOR UPDATE SKIP LOCKED``, publish them with acks in flight, mark them with one UPDATE.

Figures are medians over ``--repeat`` runs; each is also given as a ratio to the baseline.

Then the same backlog is drained into every broker of ``--brokers`` (see ``bench._brokers``),
once per worker count, timed by the database's clock and counted at the broker.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import asyncpg
import nats

from bench._brokers import KINDS, NOTES, drain_into, harnesses
from bench._common import (
    NATS_URL,
    RouterProcess,
    Stream,
    fresh_database,
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
    conn = await asyncpg.connect(url)
    try:
        for start in range(0, events, PER_TRANSACTION):
            async with conn.transaction():
                for first in range(start, min(start + PER_TRANSACTION, events), PER_ORDER):
                    await outbox.stage(
                        conn,
                        *(order(i) for i in range(first, min(first + PER_ORDER, events))),
                        stream_key=f"order-{first // PER_ORDER}",
                    )
    finally:
        await conn.close()


async def run_router(events: int, workers: int) -> float:
    """Events/s of ``router serve --workers N`` draining a fresh backlog."""
    async with fresh_database("drain") as url, fresh_stream("drain") as stream:
        await stage_backlog(url, stream, events)
        config = router_config(url, stream, batch_size=500)
        with RouterProcess(config, "--workers", str(workers)):
            first, last = await wait_for_count(stream, events)
        return events / (last - first) if last > first else float("inf")


async def run_baseline(events: int, batch: int = 500) -> float:
    """Events/s of the hand-written relay on an identical backlog."""
    async with fresh_database("base") as url, fresh_stream("base") as stream:
        await stage_backlog(url, stream, events)
        timing = asyncio.create_task(wait_for_count(stream, events))
        await baseline_relay(url, batch)
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


async def main() -> None:
    """Run every variant ``--repeat`` times; print and save the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--brokers", nargs="*", choices=KINDS, default=list(KINDS))
    args = parser.parse_args()

    runs: dict[str, list[float]] = {"baseline": []}
    for workers in args.workers:
        runs[f"router serve --workers {workers}"] = []
    for round_ in range(args.repeat):
        runs["baseline"].append(await run_baseline(args.events))
        for workers in args.workers:
            runs[f"router serve --workers {workers}"].append(await run_router(args.events, workers))
        print(
            f"round {round_ + 1}/{args.repeat}: "
            + ", ".join(f"{name} {values[-1]:,.0f}/s" for name, values in runs.items()),
            flush=True,
        )

    baseline = median(runs["baseline"])
    figures: dict[str, Any] = {}
    rows = []
    for name, values in runs.items():
        rate = median(values)
        figures[name] = {
            "events_per_second": round(rate),
            "runs": [round(v) for v in values],
            "ratio_to_baseline": round(rate / baseline, 3),
        }
        rows.append(
            (name, f"{rate:,.0f}", f"{rate / baseline:.2f}x", " ".join(f"{v:,.0f}" for v in values))
        )
    print_table(
        f"drain: {args.events:,} events from PostgreSQL into JetStream (median of {args.repeat})",
        ["relay", "events/s", "vs baseline", "runs"],
        rows,
    )
    per_broker = await drain_per_broker(args.events, args.workers, args.brokers, baseline)
    path = write_results(
        "drain",
        {
            "events": args.events,
            "repeat": args.repeat,
            "events_per_order": PER_ORDER,
            "events_per_transaction": PER_TRANSACTION,
            "batch_size": 500,
        },
        {**figures, "per_broker": per_broker},
    )
    print(f"written to {path.relative_to(path.parents[2])}")


if __name__ == "__main__":
    asyncio.run(main())
