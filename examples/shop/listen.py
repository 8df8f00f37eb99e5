"""Print what arrives at each broker of the config (NATS JetStream streams).

    python examples/shop/listen.py          # follow: Ctrl-C to stop
    python examples/shop/listen.py --once   # print what is stored, then exit

It reads every stream from the beginning with an ordered consumer, so it shows events
published before it started too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from typing import Any

import nats
from nats.js.api import DeliverPolicy

from brokers.nats import NatsSettings
from router import load_config


async def follow(name: str, settings: NatsSettings, once: bool, idle: float) -> int:
    """Print each message of one broker's stream; return how many were printed."""
    client = await nats.connect(settings.servers())
    js = client.jetstream()
    seen = 0
    done = asyncio.Event()

    async def show(msg: Any) -> None:
        nonlocal seen
        seen += 1
        body = json.loads(msg.data)
        print(f"[{name}] {msg.subject}  Nats-Msg-Id={msg.headers.get('Nats-Msg-Id')}")
        print("    " + json.dumps(body, indent=None, sort_keys=True))

    subscriptions = [
        await js.subscribe(
            subject, cb=show, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL
        )
        for subject in settings.stream.subjects
    ]
    try:
        if once:
            last = -1
            while last != seen:
                last = seen
                await asyncio.sleep(idle)
        else:
            await done.wait()
    finally:
        for subscription in subscriptions:
            await subscription.unsubscribe()
        await client.close()
    return seen


async def main() -> None:
    """Follow every NATS broker of the config at once."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", default=os.environ.get("ROUTER_CONFIG", "config.yaml"))
    parser.add_argument("--once", action="store_true", help="print what is stored, then exit")
    parser.add_argument("--idle", type=float, default=1.0, help="with --once: quiet seconds")
    args = parser.parse_args()
    config = load_config(args.config)
    brokers = {n: b for n, b in config.brokers.items() if isinstance(b, NatsSettings)}
    counts = await asyncio.gather(
        *(follow(name, settings, args.once, args.idle) for name, settings in brokers.items())
    )
    if args.once:
        for name, count in zip(brokers, counts, strict=True):
            print(f"{name}: {count} message(s)")


if __name__ == "__main__":
    asyncio.run(main())
