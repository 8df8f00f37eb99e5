"""One trickle run: a freshly started ``router serve`` against one producer committing one
event per transaction at a steady rate, with what the outbox table holds sampled every second.
See ``bench.trickle`` for the scenario and the report."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import nats
from nats.js.api import StorageType

from bench._common import (
    NATS_URL,
    RouterProcess,
    Stream,
    fresh_database,
    fresh_stream,
    order,
    router_config,
)
from router import Outbox
from router.config import RouterConfig
from router.relay.store.postgres_sql import RING_SLOTS

__all__ = ["Sample", "Trace", "Variant", "run"]

# After the producer stops: wait for the rest while arrivals keep coming, at most this long.
DRAIN_IDLE_SECONDS = 15.0
DRAIN_MAX_SECONDS = 180.0

OPEN = "status IN ('pending', 'processing', 'failed')"
# The outbox's tables (on PostgreSQL it is partitioned, migration 0011): the history and the
# queue's slots, whose figures add up to the table's.
TABLES = ["router_outbox_done", *(f"router_outbox_q{slot}" for slot in range(RING_SLOTS))]
SAMPLE_SQL = f"""
SELECT sum(s.n_dead_tup)::bigint, sum(s.n_live_tup)::bigint,
       sum(s.vacuum_count + s.autovacuum_count)::bigint,
       (SELECT count(*) FROM router_outbox_queue WHERE {OPEN})
FROM pg_stat_user_tables s WHERE s.relname = ANY(ARRAY{TABLES!r})
"""


@dataclass(frozen=True)
class Variant:
    """How the outbox table gets vacuumed in a run."""

    name: str
    table_autovacuum: bool | None  # per-table autovacuum_enabled to set (None: leave it)
    vacuum_after_rows: int | None  # the router's outbox.vacuum_after_rows (None: its default)
    note: str


@dataclass(frozen=True)
class Sample:
    """The outbox table at ``at`` seconds into the run."""

    at: float
    dead: int
    live: int
    vacuums: int
    open: int


@dataclass
class Trace:
    """What one run recorded; times are epoch seconds, ``started`` when the router was
    spawned and the producer began."""

    started: float = 0.0
    produced: float = 0.0
    committed: dict[str, float] = field(default_factory=dict)
    arrived: dict[str, float] = field(default_factory=dict)
    transaction_ms: dict[str, float] = field(default_factory=dict)  # BEGIN to COMMIT returned
    samples: list[Sample] = field(default_factory=list)
    router_exit: int | None = None
    router_log: str = ""


def trickle_config(url: str, stream: Stream, variant: Variant) -> dict[str, Any]:
    """The router's config: one database, the file stream (checked, not created)."""
    outbox: dict[str, Any] = (
        {}
        if variant.vacuum_after_rows is None
        else {"vacuum_after_rows": variant.vacuum_after_rows}
    )
    return router_config(url, stream, **outbox)


async def run(
    variant: Variant, rate: float, seconds: float, *, producer_sync: bool = True
) -> Trace:
    """One run on a fresh database and a fresh file-storage stream; with ``producer_sync``
    off the producer's commits do not wait for the WAL flush (the router's work is the same:
    it sees a row at its commit either way)."""
    trace = Trace()
    async with (
        fresh_database("trickle") as url,
        fresh_stream("trickle", StorageType.FILE) as stream,
    ):
        config = trickle_config(url, stream, variant)
        outbox = Outbox(RouterConfig.model_validate(config).with_base_dir(Path.cwd()))
        client = await nats.connect(NATS_URL)

        async def on_message(msg: Any) -> None:
            trace.arrived.setdefault(msg.headers["Nats-Msg-Id"], time.time())

        await client.subscribe(stream.subject + ".>", cb=on_message)
        # Both connections exist before the clock starts: the application is already running
        # when the router is (re)started, only the router is fresh.
        producer = await asyncpg.connect(
            url, server_settings={} if producer_sync else {"synchronous_commit": "off"}
        )
        monitor = await connect_monitor(url, variant)
        try:
            trace.started = time.time()
            with RouterProcess(config) as router:
                sampler = asyncio.create_task(sample(monitor, trace))
                try:
                    await produce(outbox, producer, rate, seconds, trace)
                    await wait_for_arrivals(trace)
                finally:
                    sampler.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await sampler
                trace.router_exit = router.process.poll()
                trace.router_log = str(router.folder / "router.log")
        finally:
            await producer.close()
            await monitor.close()
            await client.close()
    return trace


async def connect_monitor(url: str, variant: Variant) -> asyncpg.Connection:
    """The sampling connection; sets the variant's per-table autovacuum first."""
    conn = await asyncpg.connect(url)
    if variant.table_autovacuum is not None:
        setting = "on" if variant.table_autovacuum else "off"
        for table in TABLES:
            await conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = {setting})")
    # An index scan marks the dead entries it walks past as dead for everyone (as VACUUM
    # would, in part), so counting the open rows by one would tidy up the very claim index
    # whose bloat we watch; a sequential scan would read the whole heap every second. A
    # bitmap scan of the partial claim index reads what a claim reads and kills no entries.
    await conn.execute(
        "SET enable_indexscan = off; SET enable_indexonlyscan = off; SET enable_seqscan = off"
    )
    return conn


async def produce(
    outbox: Outbox, conn: asyncpg.Connection, rate: float, seconds: float, trace: Trace
) -> None:
    """One transaction per event, each its own stream key, on absolute deadlines: a late
    commit is followed at once by the next one due, so the offered rate does not drift."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    for i in range(math.ceil(rate * seconds)):
        delay = start + i / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        began = time.time()
        async with conn.transaction():
            [message_id] = await outbox.stage(conn, order(i), stream_key=f"order-{i}")
        trace.committed[message_id] = time.time()
        trace.transaction_ms[message_id] = (trace.committed[message_id] - began) * 1000
    trace.produced = time.time()


async def sample(conn: asyncpg.Connection, trace: Trace) -> None:
    """The table's figures at the end of every second of the run, until cancelled. Each
    query is a transaction of its own, so the monitor holds back no vacuum horizon."""
    loop = asyncio.get_running_loop()
    start = loop.time() - (time.time() - trace.started)
    tick = 1
    while True:
        await asyncio.sleep(max(0.0, start + tick - loop.time()))
        row = await conn.fetchrow(SAMPLE_SQL)
        if row is not None and row[0] is not None:  # None until the statistics know it
            trace.samples.append(Sample(round(time.time() - trace.started, 3), *row))
        tick = max(tick + 1, math.floor(loop.time() - start) + 1)


async def wait_for_arrivals(trace: Trace) -> None:
    """Until every committed event arrived, or arrivals stopped coming, or the cap."""
    deadline = time.monotonic() + DRAIN_MAX_SECONDS
    seen, idle_since = -1, time.monotonic()
    while len(trace.arrived) < len(trace.committed) and time.monotonic() < deadline:
        if len(trace.arrived) != seen:
            seen, idle_since = len(trace.arrived), time.monotonic()
        elif time.monotonic() - idle_since > DRAIN_IDLE_SECONDS:
            return
        await asyncio.sleep(0.1)
