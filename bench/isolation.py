"""isolation: the internal target's throughput while a partner is dead or hanging.

    python -m bench.isolation [--events 20000] [--repeat 3]

A backlog of published events (each one row for the internal NATS broker and one for a
partner) is drained by ``router serve`` while the partner is healthy (a real NATS stream),
dead (nothing listens on its port) or hanging (a server that accepts the connection and never
answers). The figure is the internal target's events/s, and its ratio to the healthy run.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from bench._common import (
    NATS_URL,
    RouterProcess,
    Stream,
    fresh_database,
    fresh_stream,
    median,
    print_table,
    router_config,
    wait_for_count,
    write_results,
)
from bench.drain import stage_backlog
from tests.services import free_port

SCENARIOS = ("healthy", "dead", "hanging")


@asynccontextmanager
async def partner_url(scenario: str) -> AsyncIterator[str]:
    """Where the partner broker is, for one scenario."""
    if scenario == "healthy":
        yield NATS_URL
        return
    if scenario == "dead":
        yield f"nats://127.0.0.1:{free_port()}"
        return
    held: list[asyncio.StreamWriter] = []

    async def say_nothing(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(say_nothing, "127.0.0.1", 0)
    try:
        yield f"nats://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        for writer in held:
            writer.close()


async def run(scenario: str, events: int) -> float:
    """The internal target's events/s in one scenario."""
    async with (
        fresh_database("iso") as url,
        fresh_stream("iso") as internal,
        fresh_stream("isop") as partner,
        partner_url(scenario) as partner_nats,
    ):
        config = router_config(url, internal, batch_size=500)
        config["brokers"]["partner"] = partner_broker(partner, partner_nats)
        await stage_backlog(url, internal, events, brokers=config["brokers"])
        with RouterProcess(config):
            first, last = await wait_for_count(internal, events)
        return events / (last - first)


def partner_broker(stream: Stream, url: str) -> dict[str, Any]:
    """An external NATS broker for the partner."""
    return {
        "type": "nats",
        "url": url,
        "destination": stream.destination,
        "connect_timeout": 5,
        "publish_timeout": 10,
        "stream": {
            "name": stream.name,
            "subjects": [stream.subject + ".>"],
            "storage": "memory",
            "create": False,
        },
    }


async def main() -> None:
    """Measure each scenario ``--repeat`` times; print and save the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[float]] = {s: [] for s in SCENARIOS}
    for _ in range(args.repeat):
        for scenario in SCENARIOS:
            runs[scenario].append(await run(scenario, args.events))
    healthy = median(runs["healthy"])
    figures = {
        s: {
            "internal_events_per_second": round(median(v)),
            "ratio_to_healthy": round(median(v) / healthy, 3),
            "runs": [round(x) for x in v],
        }
        for s, v in runs.items()
    }
    print_table(
        f"isolation: internal target draining {args.events:,} events (median of {args.repeat})",
        ["partner", "internal events/s", "vs healthy"],
        [(s, f"{median(v):,.0f}", f"{median(v) / healthy:.0%}") for s, v in runs.items()],
    )
    path = write_results("isolation", {"events": args.events, "repeat": args.repeat}, figures)
    print(f"written to {path.relative_to(path.parents[2])}")


if __name__ == "__main__":
    asyncio.run(main())
