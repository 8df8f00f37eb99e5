"""memory: the router's peak memory while draining a very large backlog.

    python -m bench.memory [--events 1000000]

A backlog of ``--events`` rows (realistic envelopes, four events per stream key) is written
straight into a fresh outbox with SQL, then one ``router serve`` process drains it into a
JetStream stream that keeps only the newest 100,000 messages (so NATS's own memory stays
small). The router's resident memory is sampled from /proc every half second; the figure is
its peak (VmHWM), with the drain's duration and rate.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import asyncpg
import nats
from nats.js.api import DiscardPolicy, StorageType, StreamConfig

from bench._common import (
    NATS_URL,
    RouterProcess,
    Stream,
    fresh_database,
    print_table,
    router_config,
    write_results,
)

FILL = """
INSERT INTO router_outbox (message_id, target, destination, event_type, stream_key, envelope)
SELECT id, 'events', $1, 'order_placed', 'order-' || (i / 4),
       json_build_object(
           'id', id, 'type', 'order_placed', 'version', 1,
           'time', to_char(now() AT TIME ZONE 'utc', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
           'source', 'bench', 'stream', 'order-' || (i / 4), 'asynchronous', true,
           'checksum', 'sha256:' || md5(i::text) || md5(i::text), 'headers', '{}'::json,
           'extensions', '{}'::json, 'event_class', 'bench._common.OrderPlaced',
           'payload', json_build_object('order_id', 'order-' || i,
                                        'customer', 'customer-' || (i % 997),
                                        'total', (i % 1000) || '.99', 'lines', 1 + i % 5))
FROM (SELECT gen_random_uuid() AS id, i FROM generate_series($2::bigint, $3::bigint) AS i) AS s
"""


async def fill(url: str, stream: Stream, events: int) -> None:
    """Write the backlog in chunks of 100,000 rows."""
    conn = await asyncpg.connect(url)
    try:
        for start in range(0, events, 100_000):
            end = min(start + 100_000, events) - 1
            await conn.execute(FILL, stream.subject + ".order_placed", start, end)
        await conn.execute("ANALYZE router_outbox")
    finally:
        await conn.close()


async def open_rows(url: str) -> bool:
    """Is anything left to deliver? (Through the partial index: cheap on a big table.)"""
    conn = await asyncpg.connect(url)
    try:
        return bool(
            await conn.fetchval(
                "SELECT EXISTS (SELECT 1 FROM router_outbox "
                "WHERE status IN ('pending', 'processing', 'failed'))"
            )
        )
    finally:
        await conn.close()


def memory_kb(pid: int, field: str) -> int:
    """VmRSS / VmHWM of a process, in kB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


async def main() -> None:
    """Fill, drain, sample; print and save."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    args = parser.parse_args()
    stream = Stream(f"BENCH_MEMORY_{int(time.time())}", f"benchmem{int(time.time())}")
    client = await nats.connect(NATS_URL)
    js = client.jetstream()
    await js.add_stream(
        StreamConfig(
            name=stream.name,
            subjects=[stream.subject + ".>"],
            storage=StorageType.MEMORY,
            max_msgs=100_000,
            discard=DiscardPolicy.OLD,
        )
    )
    try:
        async with fresh_database("memory") as url:
            started = time.perf_counter()
            await fill(url, stream, args.events)
            filled = time.perf_counter() - started
            print(f"backlog of {args.events:,} rows written in {filled:.0f} s", flush=True)
            peak_rss = 0
            with RouterProcess(router_config(url, stream, batch_size=500)) as router:
                pid = router.process.pid
                started = time.perf_counter()
                while await open_rows(url):
                    peak_rss = max(peak_rss, memory_kb(pid, "VmRSS"))
                    await asyncio.sleep(0.5)
                drained = time.perf_counter() - started
                high_water = memory_kb(pid, "VmHWM")
    finally:
        await js.delete_stream(stream.name)
        await client.close()
    peak = max(peak_rss, high_water) / 1024
    print_table(
        f"memory: router serve draining {args.events:,} rows",
        ["rows", "drain (s)", "events/s", "peak RSS (MB)"],
        [(f"{args.events:,}", f"{drained:.0f}", f"{args.events / drained:,.0f}", f"{peak:.0f}")],
    )
    path = write_results(
        "memory",
        {"events": args.events, "batch_size": 500},
        {
            "peak_rss_mb": round(peak, 1),
            "drain_seconds": round(drained, 1),
            "events_per_second": round(args.events / drained),
        },
    )
    print(f"written to {path.relative_to(path.parents[2])}")


if __name__ == "__main__":
    asyncio.run(main())
