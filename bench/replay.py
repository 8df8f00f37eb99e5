"""replay: how long a paced replay to one target takes, and that it touches no other target.

    python -m bench.replay [--events 10000] [--rate 2000] [--rounds 3]

Each round: a fresh database and two fresh **file** streams (the internal broker's and a
partner's); ``--events`` events staged (one stream key per 100 events) and delivered to both
by ``router serve``; then, with serve still running, ``router replay --target partners --rate
N`` is run as a command. Timed from the command's exec to the moment the last replayed row
was marked published again (the broker acknowledged it; JetStream, holding the same message
ids within its duplicate window, acknowledges them as duplicates without storing them again),
so the figure includes the command's start-up, its paced batches and the delivery of the
last batch. Afterwards the internal
stream must still hold exactly ``--events`` messages. The expected time is events / rate.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path
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
    nats_broker,
    order,
    print_table,
    router_config,
    wait_for_count,
    write_results,
)
from router import Outbox
from router.config import RouterConfig


async def stage(url: str, config: dict[str, Any], events: int) -> None:
    outbox = Outbox(RouterConfig.model_validate(config))
    try:
        for start in range(0, events, 500):
            count = min(500, events - start)
            async with outbox.transaction() as tx:
                await tx.stage(
                    *(order(i) for i in range(start, start + count)),
                    stream_keys=[f"customer-{i // 100}" for i in range(start, start + count)],
                )
    finally:
        await outbox.close()


async def republished(url: str, events: int, since: float, timeout: float = 300) -> float:
    """When the last replayed row was marked published again (the database's clock, epoch
    seconds). The stream cannot tell: JetStream drops a message whose id it stored within
    its duplicate window, which is what a replay with the original ids is for."""
    conn = await asyncpg.connect(url)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done, last = await conn.fetchrow(
                "SELECT count(*), extract(epoch FROM max(published_at))::float8"
                " FROM router_outbox WHERE target = 'partners' AND status = 'published'"
                " AND published_at >= to_timestamp($1)",
                since,
            )
            if done >= events:
                return float(last)
            await asyncio.sleep(0.05)
    finally:
        await conn.close()
    raise TimeoutError("the replayed rows were not all published again")


async def count(stream: str) -> int:
    client = await nats.connect(NATS_URL)
    try:
        return int((await client.jetstream().stream_info(stream)).state.messages)
    finally:
        await client.close()


async def one_round(events: int, rate: float) -> dict[str, Any]:
    async with (
        fresh_database("replay") as url,
        fresh_stream("internal", StorageType.FILE) as internal,
        fresh_stream("partner", StorageType.FILE) as partner,
    ):
        config = router_config(url, internal)
        config["brokers"]["partners"] = nats_broker(partner)
        await stage(url, config, events)
        with RouterProcess(config) as router:
            await wait_for_count(internal, events)
            await wait_for_count(partner, events)
            command = [
                str(Path(sys.executable).with_name("router")),
                "replay",
                "--target",
                "partners",
                "--rate",
                str(rate),
                "--json",
            ]
            started = time.time()
            done = await asyncio.to_thread(
                subprocess.run, command, cwd=router.folder, capture_output=True, text=True
            )
            if done.returncode != 0:
                raise RuntimeError(f"router replay failed: {done.stderr or done.stdout}")
            last = await republished(url, events, started)
            await asyncio.sleep(1)  # anything sent to the internal stream by mistake shows
            internal_after = await count(internal.name)
            partner_after = await count(partner.name)
    seconds = last - started
    return {
        "seconds": round(seconds, 3),
        "expected_seconds": round(events / rate, 3),
        "achieved_rate": round(events / seconds, 1),
        "command_seconds": round(time.time() - started, 3),
        "internal_messages_after": internal_after,
        "partner_messages_after": partner_after,  # duplicates are not stored again
        "internal_unchanged": internal_after == events,
    }


async def main(args: argparse.Namespace) -> None:
    rounds = [await one_round(args.events, args.rate) for _ in range(args.rounds)]
    seconds = [r["seconds"] for r in rounds]
    expected = args.events / args.rate
    print_table(
        f"replay {args.events:,} events to one target at --rate {args.rate:,.0f}/s "
        f"(expected {expected:.1f} s), file streams",
        ["round", "seconds", "achieved/s", "vs expected", "internal unchanged"],
        [
            (
                n + 1,
                f"{r['seconds']:.2f}",
                f"{r['achieved_rate']:,.0f}",
                f"{100 * (r['seconds'] / expected - 1):+.1f}%",
                "yes" if r["internal_unchanged"] else "NO",
            )
            for n, r in enumerate(rounds)
        ],
    )
    print(
        f"median {median(seconds):.2f} s (min {min(seconds):.2f}, max {max(seconds):.2f}); "
        f"expected {expected:.2f} s"
    )
    write_results(
        "replay",
        {"events": args.events, "rate": args.rate, "rounds": args.rounds},
        {"rounds": rounds, "median_seconds": median(seconds), "expected_seconds": expected},
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--rate", type=float, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    uvloop.run(main(parser.parse_args()))
