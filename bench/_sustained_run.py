"""One sustained run: a fresh ``router serve`` delivering to three file streams while producers
commit at a steady offered rate. See ``bench.sustained`` for the scenario and the report."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import nats
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StorageType
from nats.js.errors import FetchTimeoutError

from bench._common import (
    NATS_URL,
    RouterProcess,
    Stream,
    fresh_database,
    fresh_stream,
    nats_broker,
    order,
    router_config,
)
from router import Outbox
from tests.conftest import make_config

__all__ = ["TARGETS", "Plan", "Trace", "run"]

TARGETS = (
    "events",
    "partner_a",
    "partner_b",
)  # the internal broker first, as router_config names it
WARMUP_KEY = "warmup"
WARMUP_TIMEOUT = 60.0
# After the producers stop: wait while deliveries keep coming, at most this long. A router
# still a minute behind has not held the rate; what it left undelivered says by how much,
# and the machine is shared, so it is not waited for.
TAIL_IDLE_SECONDS = 15.0
TAIL_MAX_SECONDS = 60.0
READ_BATCH = 2000


@dataclass(frozen=True)
class Plan:
    """What one run offers: ``rate`` events/s for ``seconds``, from one connection committing
    one event per transaction (single) or ``connections`` each committing ``per_transaction``."""

    mode: str
    rate: float
    seconds: float
    connections: int
    per_transaction: int

    @property
    def shape(self) -> tuple[int, int]:
        """(connections, events per transaction)."""
        return (1, 1) if self.mode == "single" else (self.connections, self.per_transaction)


@dataclass
class Trace:
    """What one run recorded; times are epoch seconds, ``started`` when the measured period
    began (after the warm-up event reached every target)."""

    spawned: float = 0.0
    warm_up_s: float = 0.0
    started: float = 0.0
    produced: float = 0.0
    committed: dict[str, float] = field(default_factory=dict)
    lateness_ms: list[float] = field(default_factory=list)  # per transaction, BEGIN vs deadline
    stored: dict[str, dict[str, float]] = field(default_factory=dict)  # target -> id -> time
    duplicates: dict[str, int] = field(default_factory=dict)
    tail_s: float = 0.0
    router_exit: int | None = None
    router_log: str = ""


@contextlib.asynccontextmanager
async def three_streams() -> AsyncIterator[dict[str, Stream]]:
    """A fresh file stream per target."""
    async with (
        fresh_stream("sustained", StorageType.FILE) as internal,
        fresh_stream("sustaineda", StorageType.FILE) as first,
        fresh_stream("sustainedb", StorageType.FILE) as second,
    ):
        yield dict(zip(TARGETS, (internal, first, second), strict=True))


async def run(plan: Plan) -> Trace:
    """One run on a fresh database, fresh streams and a freshly started router."""
    trace = Trace()
    connections, _ = plan.shape
    async with fresh_database("sustained") as url, three_streams() as streams:
        config = router_config(url, streams["events"])
        config["brokers"] |= {t: nats_broker(streams[t]) for t in TARGETS[1:]}
        outbox = Outbox(make_config({"main": url}, config["brokers"]))
        client = await nats.connect(NATS_URL)
        # The application is already running when the router starts: its connections exist.
        producers = [await asyncpg.connect(url) for _ in range(connections)]
        try:
            trace.spawned = time.time()
            with RouterProcess(config, "--workers", "1") as router:
                await warm_up(outbox, producers[0], client, streams, router)
                trace.warm_up_s = time.time() - trace.spawned
                await produce(outbox, producers, plan, trace)
                await wait_for_tail(client, streams, len(trace.committed) + 1, trace, router)
                trace.router_exit = router.process.poll()
                trace.router_log = str(router.folder / "router.log")
            # Read back once the router is gone, so reading costs the measurement nothing.
            for target, stream in streams.items():
                trace.stored[target], trace.duplicates[target] = await read_stored(client, stream)
        finally:
            for conn in producers:
                await conn.close()
            await client.close()
    return trace


async def warm_up(
    outbox: Outbox,
    conn: asyncpg.Connection,
    client: Any,
    streams: dict[str, Stream],
    router: RouterProcess,
) -> None:
    """Stage one event and wait until every target stored it: the router's start-up
    (imports, connections, the first claim) is then behind us, not in the measured period."""
    async with conn.transaction():
        await outbox.stage(conn, order(-1), stream_key=WARMUP_KEY)
    deadline = time.monotonic() + WARMUP_TIMEOUT
    while min((await counts(client, streams)).values()) < 1:
        if router.process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"router never delivered the warm-up event; see {router.folder}")
        await asyncio.sleep(0.05)


async def produce(
    outbox: Outbox, producers: list[asyncpg.Connection], plan: Plan, trace: Trace
) -> None:
    """Transactions on absolute deadlines shared round-robin by the connections: a late one
    is followed at once by the next due, so the offered rate does not drift. None begins
    after the period: a producer that falls behind commits less, it does not run longer."""
    connections, size = plan.shape
    total = math.ceil(plan.rate * plan.seconds)
    transactions = math.ceil(total / size)
    loop = asyncio.get_running_loop()
    start = loop.time()
    trace.started = time.time()

    async def producer(index: int) -> None:
        conn = producers[index]
        for j in range(index, transactions, connections):
            due = start + j * size / plan.rate
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            elif loop.time() - start >= plan.seconds:
                return
            trace.lateness_ms.append(max(0.0, loop.time() - due) * 1000)
            events = [order(i) for i in range(j * size, min((j + 1) * size, total))]
            # One stream key per transaction: its events belong to one aggregate, as an
            # application's usually do, and the router keeps their order.
            async with conn.transaction():
                ids = await outbox.stage(conn, *events, stream_key=f"txn-{j}")
            now = time.time()
            trace.committed.update(dict.fromkeys(ids, now))

    await asyncio.gather(*(producer(c) for c in range(connections)))
    trace.produced = time.time()


async def counts(client: Any, streams: dict[str, Stream]) -> dict[str, int]:
    """Messages stored per target (stream info: one request each, nothing read)."""
    js = client.jetstream()
    return {t: int((await js.stream_info(s.name)).state.messages) for t, s in streams.items()}


async def wait_for_tail(
    client: Any, streams: dict[str, Stream], expected: int, trace: Trace, router: RouterProcess
) -> None:
    """Until every target holds ``expected`` messages, deliveries stop coming, or the cap.
    Polled every 250 ms: the router shares the two cores with this process."""
    begun = time.monotonic()
    seen, idle_since = -1, begun
    while time.monotonic() - begun < TAIL_MAX_SECONDS and router.process.poll() is None:
        stored = await counts(client, streams)
        if min(stored.values()) >= expected:
            break
        if sum(stored.values()) != seen:
            seen, idle_since = sum(stored.values()), time.monotonic()
        elif time.monotonic() - idle_since > TAIL_IDLE_SECONDS:
            break
        await asyncio.sleep(0.25)
    trace.tail_s = time.time() - trace.produced


async def read_stored(client: Any, stream: Stream) -> tuple[dict[str, float], int]:
    """Message id -> when JetStream stored it (its own timestamp, taken as it stores the
    message, just before it acks the router), and how many ids came more than once."""
    js = client.jetstream()
    expected = int((await js.stream_info(stream.name)).state.messages)
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE, headers_only=True
    )
    sub = await js.pull_subscribe(stream.subject + ".>", stream=stream.name, config=config)
    stored: dict[str, float] = {}
    read = duplicates = 0
    try:
        while read < expected:
            try:
                batch = await sub.fetch(READ_BATCH, timeout=5)
            except FetchTimeoutError:
                break
            for msg in batch:
                read += 1
                message_id = msg.headers["Nats-Msg-Id"]
                duplicates += message_id in stored
                stored.setdefault(message_id, msg.metadata.timestamp.timestamp())
    finally:
        await sub.unsubscribe()
    return stored, duplicates
