"""A processor whose only open rows wait (a failed row retrying later, the rest of its stream
behind it) sleeps until the retry is due: it does not claim in vain meanwhile. On every
database."""

from __future__ import annotations

import asyncio
import time
from decimal import Decimal

from brokers import Broker, BrokerSettings, MemoryBroker, OutgoingMessage, PublishResult
from router import Runner
from router.relay.store import Claim
from tests.conftest import make_config
from tests.integration.events import OrderPlaced
from tests.integration.test_write_path import Database, database  # noqa: F401 (fixture)

RETRY_IN = 3.0


def failing_first(message: OutgoingMessage) -> PublishResult | None:
    """o-0 fails (retryable); the rest would go through."""
    if b'"o-0"' in message.wire.body:
        return PublishResult.failed("partner said try later", retryable=True)
    return None


async def test_a_stream_held_behind_a_retry_is_not_claimed_until_the_retry_is_due(
    database: Database,  # noqa: F811
) -> None:
    brokers = {"events": {"type": "memory", "internal": True}}
    config = make_config(
        {"main": database.url},
        brokers,
        base_dir=database.base_dir,
        outbox={
            "retry": {"base_delay": RETRY_IN, "max_delay": RETRY_IN, "jitter": 0},
            "poll_interval": 60,
        },
    )
    outbox = database.outbox(brokers)
    async with outbox.transaction() as tx:
        await tx.stage(
            *(OrderPlaced(order_id=f"o-{i}", total=Decimal(i)) for i in range(2)),
            stream_key="s",
        )
    await outbox.close()

    def factory(name: str, settings: BrokerSettings) -> Broker:
        return MemoryBroker(name, handler=failing_first)

    supervisor = Runner(config, broker_factory=factory, serve_http=False, run_cleanup=False)
    store = supervisor.stores["main"]
    claims: list[float] = []
    claim = store.claim

    async def counted(
        target: str,
        limit: int,
        worker: str,
        lease_seconds: float,
        after: Claim | None = None,
        *,
        units: bool = False,
    ) -> Claim:
        claims.append(time.monotonic())
        return await claim(target, limit, worker, lease_seconds, after, units=units)

    store.claim = counted  # type: ignore[method-assign]  # count the store's claims
    await supervisor.start()
    try:
        deadline = time.monotonic() + 10
        while not supervisor.processors[0].stats.failed:
            assert time.monotonic() < deadline, "the first publish never failed"
            await asyncio.sleep(0.02)
        failed_at = time.monotonic()
        await asyncio.sleep(RETRY_IN - 1)
    finally:
        await supervisor.shutdown()

    # Claiming every 50 ms made about 40 here. A wake-up may still bring a claim or two: the
    # MariaDB store's watcher looks again shortly after each change it saw (the mark).
    waiting = [t for t in claims if t > failed_at]
    assert len(waiting) <= 3, f"{len(waiting)} claims while the only stream waited"
