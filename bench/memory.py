"""memory: the router's peak memory while draining a very large backlog, and its claim plan.

    python -m bench.memory [--events 1000000] [--seconds S] [--output memory]

A backlog of ``--events`` rows (realistic envelopes, four events per stream key) is written
straight into a fresh outbox with SQL and analyzed, then one ``router serve`` process drains
it into a JetStream stream that keeps only the newest 100,000 messages (so NATS's own memory
stays small). Before the drain, the claim's plan on the full backlog is printed as
``router_claim()`` runs it (EXPLAIN ANALYZE of its query under its planner settings, rolled
back). The router's resident memory is sampled from /proc every half second, and every 10 s
with the messages published so far; the figure is its peak (VmHWM), with the drain's
duration and rate. ``--seconds`` stops the drain after that long (a 10,000,000-row backlog
takes a quarter of an hour to drain here; memory is flat well before), and the claim's plan
is shown again on what is left.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

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
from router.ops.pg_health import claim_plan_problem, explain_claim

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


async def claim_plan(url: str) -> tuple[str, str | None]:
    """The claim's plan on the backlog as it is now (executed and rolled back), and what
    ``router check`` would say of it (None: index-served)."""
    conn = await asyncpg.connect(url)
    try:
        problem = await claim_plan_problem(conn, "events")
        return await explain_claim(conn, "events", "(ANALYZE, BUFFERS)"), problem
    finally:
        await conn.close()


async def published(js: Any, stream: Stream) -> int:
    """Messages the stream has taken so far (it keeps only the newest, but counts them all)."""
    return int((await js.stream_info(stream.name)).state.last_seq)


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


async def drain(
    url: str, js: Any, stream: Stream, seconds: float
) -> tuple[float, int, int, list[dict[str, float]]]:
    """One ``router serve`` drains the backlog (for at most ``seconds``, when given): how long
    it ran, what it published, its peak RSS in kB, and the samples every 10 s."""
    peak_rss = 0
    samples: list[dict[str, float]] = []
    with RouterProcess(router_config(url, stream, batch_size=500)) as router:
        pid = router.process.pid
        started = time.perf_counter()
        elapsed = 0.0
        while await open_rows(url) and not (seconds and elapsed >= seconds):
            rss = memory_kb(pid, "VmRSS")
            peak_rss = max(peak_rss, rss)
            if not samples or elapsed - samples[-1]["s"] >= 10:
                done = await published(js, stream)
                samples.append({"s": round(elapsed), "published": done, "rss_mb": rss // 1024})
                print(
                    f"  {elapsed:5.0f} s  {done:>12,} published  RSS {rss // 1024} MB", flush=True
                )
            await asyncio.sleep(0.5)
            elapsed = time.perf_counter() - started
        drained = time.perf_counter() - started
        peak_rss = max(peak_rss, memory_kb(pid, "VmHWM"))
    return drained, await published(js, stream), peak_rss, samples


async def main() -> None:
    """Fill, drain, sample; print and save."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument(
        "--seconds", type=float, default=0, help="stop the drain after this long (0: drain all)"
    )
    parser.add_argument("--output", default="memory", help="bench/results/OUTPUT.json")
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
            plan, problem = await claim_plan(url)
            print(f"claim plan on the full backlog ({problem or 'index-served'}):\n{plan}")
            drained, delivered, peak_kb, samples = await drain(url, js, stream, args.seconds)
            after, after_problem = await claim_plan(url)
            print(f"claim plan after the drain ({after_problem or 'index-served'}):\n{after}")
    finally:
        await js.delete_stream(stream.name)
        await client.close()
    peak = peak_kb / 1024
    print_table(
        f"memory: router serve draining a backlog of {args.events:,} rows",
        ["backlog", "published", "drain (s)", "events/s", "peak RSS (MB)", "claim"],
        [
            (
                f"{args.events:,}",
                f"{delivered:,}",
                f"{drained:.0f}",
                f"{delivered / drained:,.0f}",
                f"{peak:.0f}",
                "index-served" if problem is None and after_problem is None else "NOT index-served",
            )
        ],
    )
    path = write_results(
        args.output,
        {"events": args.events, "batch_size": 500, "seconds": args.seconds},
        {
            "peak_rss_mb": round(peak, 1),
            "drain_seconds": round(drained, 1),
            "published": delivered,
            "events_per_second": round(delivered / drained),
            "claim_index_served": problem is None and after_problem is None,
            "claim_plan": plan.splitlines(),
            "claim_plan_after": after.splitlines(),
            "samples": samples,
        },
    )
    print(f"written to {path.relative_to(path.parents[2])}")


if __name__ == "__main__":
    asyncio.run(main())
