"""drain per broker: the same backlog drained by ``router serve`` into each kind of broker.

Every broker is the one the test suite uses (see tests/contract/harnesses.py): NATS
JetStream (a file-backed stream, as ``bench.drain``'s baselines drain into), RabbitMQ and
Redis as running on the machine; Kafka is tansu (in memory, no idempotent producer) and
Service Bus the AMQP 1.0 peer, both started here. One method serves every broker: the run
ends at the last row marked published, by the database's clock (``published_at``, written
at mark, once the broker acked), and the messages are then counted at the broker. It starts

- from the first claim: the router's ``processor.started`` log line (logged as the
  processor's loop begins, just before its first claim; the broker is connected after it, on
  the first batch), so claiming and connecting to the broker count;
- from exec: the bench's clock read just before ``router serve`` is spawned, so the
  interpreter's start and the imports count too, as ``bench.drain``'s "from exec".

``last_attempt_at`` cannot say when the first claim was: on PostgreSQL it is written at
mark, with ``published_at`` (``router_mark``), so it timed from the end of the first batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import datetime
from typing import Any

import asyncpg

from bench._common import RouterProcess, fresh_database
from tests.contract.harnesses import (
    Harness,
    KafkaHarness,
    NatsHarness,
    RabbitHarness,
    RedisHarness,
    ServiceBusHarness,
)
from tests.peers.kafka import TansuPeer
from tests.peers.servicebus import ServiceBusPeer
from tests.services import free_port

__all__ = ["KINDS", "NOTES", "broker_config", "drain_into", "harnesses"]

KINDS = ("nats", "kafka", "rabbitmq", "redis", "servicebus")

NOTES = {
    "nats": "JetStream, file stream",
    "kafka": "tansu (in memory), acks=all, idempotence off",
    "rabbitmq": "publisher confirms, persistent messages",
    "redis": "XADD",
    "servicebus": "azure-servicebus SDK against the Python AMQP 1.0 peer",
}

# The last mark: published_at is the mark's clock_timestamp() (router_mark).
PUBLISHED = """
SELECT count(*) FILTER (WHERE status = 'published'), extract(epoch FROM max(published_at))::float8
FROM router_outbox
"""


@contextlib.asynccontextmanager
async def harnesses(kinds: Sequence[str]) -> AsyncIterator[dict[str, Callable[[], Harness]]]:
    """Per broker kind, a maker of harnesses (each with fresh destinations), with the Kafka
    and Service Bus peers running; everything made is cleaned up afterwards."""
    made: list[Harness] = []
    with contextlib.ExitStack() as stack:
        makers = {kind: _maker(kind, stack, made) for kind in kinds}
        try:
            yield makers
        finally:
            for harness in made:
                with contextlib.suppress(Exception):
                    await harness.cleanup()


def _maker(kind: str, stack: contextlib.ExitStack, made: list[Harness]) -> Callable[[], Harness]:
    make: Callable[[], Harness]
    if kind == "nats":
        make = NatsHarness
    elif kind == "rabbitmq":
        make = RabbitHarness
    elif kind == "redis":
        make = RedisHarness
    elif kind == "kafka":
        tansu = TansuPeer(free_port())
        tansu.start()
        stack.callback(tansu.stop)
        make = functools.partial(KafkaHarness, tansu.bootstrap)
    else:
        peer = ServiceBusPeer(port=free_port())
        peer.start()
        stack.callback(peer.stop)
        make = functools.partial(ServiceBusHarness, peer)

    def remembered() -> Harness:
        harness = make()
        made.append(harness)
        return harness

    return remembered


def broker_config(harness: Harness) -> dict[str, Any]:
    """The harness's broker as config.yaml holds it, internal; NATS on a file stream, as the
    baselines' streams are (the harnesses use memory streams, which cost JetStream no disk)."""
    broker = harness.config(internal=True)
    if harness.kind == "nats":
        broker = harness.config(internal=True, stream={**broker["stream"], "storage": "file"})
    return broker


async def drain_into(
    harness: Harness, events: int, workers: int, stage: Any, timeout: float = 600
) -> dict[str, Any]:
    """Drain a fresh backlog of ``events`` into the harness's broker; events/s from the first
    claim and from exec, and the arrivals."""
    broker = broker_config(harness)
    destination = harness.destination("order_placed")
    await harness.prepare(destination)
    async with fresh_database(f"drain_{harness.kind}") as url:
        await stage(url, {"events": broker}, events)
        config = {
            "service": "bench",
            "databases": {"main": url},
            "brokers": {"events": broker},
            "outbox": {"batch_size": 500},
            "http": {"enabled": False},
        }
        with RouterProcess(config, "--workers", str(workers), json_log=True) as router:
            published, last_mark = await _wait_published(url, events, timeout)
            started = [_at(r) for r in router.log_events("processor.started")]
        arrived = len(await harness.arrived(destination, events, timeout=120))
    if not started:
        raise RuntimeError(f"no processor.started line in {router.folder / 'router.log'}")
    seconds, from_exec = last_mark - min(started), last_mark - router.exec_at
    return {
        "events_per_second": round(published / seconds),
        "seconds": round(seconds, 3),
        "from_exec_per_second": round(published / from_exec),
        "from_exec_seconds": round(from_exec, 3),
        "arrived": arrived,
    }


def _at(record: dict[str, Any]) -> float:
    return datetime.fromisoformat(record["time"]).timestamp()


async def _wait_published(url: str, events: int, timeout: float) -> tuple[int, float]:
    """Once every row is published (or at the timeout): the count and the last mark's time
    (epoch seconds, the database's clock: the same machine's as the bench's)."""
    conn = await asyncpg.connect(url)
    try:
        deadline = time.monotonic() + timeout
        while True:
            published, last_mark = await conn.fetchrow(PUBLISHED)
            if published >= events or time.monotonic() > deadline:
                if last_mark is None:
                    raise RuntimeError(f"nothing published within {timeout} s")
                return published, last_mark
            await asyncio.sleep(0.1)
    finally:
        await conn.close()
