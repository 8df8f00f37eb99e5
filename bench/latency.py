"""latency: commit-to-broker-ack latency, measured at a consumer.

    python bench/latency.py [--rate 100 2000] [--seconds 20 10]
                            [--wakeup auto [log notify ...]] [--linger 0 [0.002 ...]]
                            [--rounds 1] [--output latency]

``router serve`` runs as a subprocess. Producers commit one event per transaction at a steady
rate and note the time right after each COMMIT returns; a NATS subscriber on the stream's
subjects notes when each message arrives (by its ``Nats-Msg-Id``). The difference is what an
application waits between committing an event and a consumer seeing it.

``--wakeup`` sets the database's ``wakeup:`` (the writers' and the router's); with several,
each round measures each in turn (the order rotated per round), so a comparison of the
wake-ups on one server is interleaved. ``log`` needs a server with ``wal_level = logical``
(``BENCH_PG_ADMIN``). ``--linger`` sets ``outbox.linger`` the same way: each round measures
every wake-up with every linger, the order rotated per round.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from typing import Any

import asyncpg
import nats
import uvloop

from bench._common import (
    NATS_URL,
    RouterProcess,
    fresh_database,
    fresh_stream,
    order,
    print_table,
    router_config,
    write_results,
)
from router import Outbox
from tests.conftest import make_config

# Each producer commits one transaction at a time and waits for its fsync, so one producer
# offers a few hundred events/s at most. Measured here without the router: 8 connections
# commit ~3,400 transactions/s, 13 ~3,000, 20 only ~2,700 (they contend for the two cores and
# the WAL). One per 250 events/s offered (at least 4) keeps the offered rate within reach.
MIN_PRODUCERS = 4


def producers_for(rate: float) -> int:
    """How many producer connections offer ``rate`` events/s."""
    return max(MIN_PRODUCERS, math.ceil(rate / 250))


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of sorted ``values``."""
    index = max(0, min(len(values) - 1, round(q / 100 * len(values)) - 1))
    return values[index]


async def measure(
    rate: float, seconds: float, wakeup: str = "auto", linger: float = 0.0
) -> dict[str, Any]:
    """Commit ``rate`` events/s for ``seconds`` with the database's ``wakeup`` and the router's
    ``outbox.linger``; return latency figures in milliseconds."""
    async with fresh_database("latency") as url, fresh_stream("latency") as stream:
        database = {"url": url, "wakeup": wakeup}
        outbox = Outbox(
            make_config(
                {"main": database},
                {
                    "events": {
                        "type": "nats",
                        "internal": True,
                        "destination": stream.destination,
                        "stream": {"name": stream.name, "subjects": [stream.subject + ".>"]},
                    }
                },
            )
        )
        committed: dict[str, float] = {}
        arrived: dict[str, float] = {}
        client = await nats.connect(NATS_URL)

        async def on_message(msg: Any) -> None:
            arrived.setdefault(msg.headers["Nats-Msg-Id"], time.time())

        await client.subscribe(stream.subject + ".>", cb=on_message)
        with RouterProcess(router_config(database, stream, linger=linger)) as router:
            await asyncio.sleep(2.0)  # let the router start and connect
            total = int(rate * seconds)
            started = time.perf_counter()
            count = producers_for(rate)
            await asyncio.gather(
                *(produce(outbox, url, p, count, total, rate, committed) for p in range(count))
            )
            achieved = len(committed) / (time.perf_counter() - started)
            deadline = time.perf_counter() + 10
            while len(arrived) < len(committed) and time.perf_counter() < deadline:
                await asyncio.sleep(0.05)
            del router
        await client.close()
        latencies = sorted((arrived[i] - t) * 1000 for i, t in committed.items() if i in arrived)
        return {
            "rate": rate,
            "wakeup": wakeup,
            "linger_s": linger,
            "seconds": seconds,
            "producers": producers_for(rate),
            "achieved_rate": round(achieved, 1),
            "events": len(committed),
            "lost": len(committed) - len(latencies),
            "p50_ms": round(percentile(latencies, 50), 3),
            "p95_ms": round(percentile(latencies, 95), 3),
            "p99_ms": round(percentile(latencies, 99), 3),
            "max_ms": round(latencies[-1], 3),
        }


async def produce(
    outbox: Outbox,
    url: str,
    index: int,
    producers: int,
    total: int,
    rate: float,
    committed: dict[str, float],
    size: int = 1,
) -> None:
    """One of the producers: every ``producers``-th of ``total`` transactions of ``size``
    events (one stream key each), on its own connection, on schedule for ``rate`` events/s;
    notes when each event's transaction committed."""
    conn = await asyncpg.connect(url)
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        for t in range(index, total, producers):
            delay = start + t * size / rate - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            async with conn.transaction():
                ids = await outbox.stage(
                    conn, *(order(t * size + i) for i in range(size)), stream_key=f"order-{t}"
                )
            committed.update(dict.fromkeys(ids, time.time()))
    finally:
        await conn.close()


async def main() -> None:
    """Measure each rate; print and save."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, nargs="+", default=[100.0, 2000.0])
    parser.add_argument("--seconds", type=float, nargs="+", default=[20.0, 10.0])
    parser.add_argument(
        "--wakeup", nargs="+", default=["auto"], choices=["auto", "log", "notify", "poll"]
    )
    parser.add_argument("--linger", type=float, nargs="+", default=[0.0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--output", default="latency", help="bench/results/OUTPUT.json")
    args = parser.parse_args()
    seconds = args.seconds + [args.seconds[-1]] * (len(args.rate) - len(args.seconds))
    variants = [(w, linger) for w in args.wakeup for linger in args.linger]
    figures = []
    for round_ in range(args.rounds):
        shift = round_ % len(variants)
        for wakeup, linger in variants[shift:] + variants[:shift]:
            for rate, secs in zip(args.rate, seconds, strict=False):
                figure = await measure(rate, secs, wakeup, linger)
                figures.append({"round": round_ + 1, **figure})
                print(
                    f"  round {round_ + 1} {wakeup} linger {linger * 1000:g} ms"
                    f" {rate:,.0f} ev/s: p50 {figure['p50_ms']} ms, p99 {figure['p99_ms']} ms",
                    flush=True,
                )
    print_table(
        "latency: commit to arrival at a NATS consumer, router serve (1 process)",
        [
            "round",
            "wakeup",
            "linger ms",
            "rate (ev/s)",
            "achieved",
            "events",
            "lost",
            "p50 ms",
            "p95 ms",
            "p99 ms",
            "max ms",
        ],
        [
            (
                f["round"],
                f["wakeup"],
                f"{f['linger_s'] * 1000:g}",
                f"{f['rate']:,.0f}",
                f"{f['achieved_rate']:,.0f}",
                f["events"],
                f["lost"],
                f["p50_ms"],
                f["p95_ms"],
                f["p99_ms"],
                f["max_ms"],
            )
            for f in figures
        ],
    )
    parameters = {"rates": args.rate, "seconds": seconds, "wakeups": args.wakeup}
    parameters["lingers"] = args.linger
    path = write_results(args.output, parameters | {"rounds": args.rounds}, figures)
    print(f"written to {path}")


if __name__ == "__main__":
    uvloop.run(main())  # as router serve runs: the producers' own overhead stays small
