"""Three ``router serve --workers 2`` on one PostgreSQL database, standing for three hosts: one
is SIGKILLed with its whole process group, so nothing is left to give its leases back. The
other two, idle by then, take its rows over as the leases end, not later, and every event
arrives in the order of its stream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import asyncpg

from tests.chaos.proxy import DelayingProxy
from tests.conftest import NatsStreams
from tests.e2e.helpers import Serving
from tests.e2e.test_worker_recovery import (
    POOL_ENV,
    STREAMS,
    both_ready,
    log_events,
    stage,
    stream,
    through,
    until,
    write_config,
)

HOSTS = ("host-a", "host-b", "host-c")
VICTIM, SURVIVORS = HOSTS[0], HOSTS[1:]
TOTAL = 300
# A claim skips streams another claim holds: six workers with up to two batches in flight
# each all find rows (12 x 4 <= STREAMS), so every host holds leases from the start.
BATCH = 4
# Acks come back late: a host holds each batch at least this long, so some of what it holds
# is in flight when the kill lands.
ACK_DELAY = 0.5
# A NATS handshake through the proxy waits for two late answers (INFO, then PONG).
CONNECT_TIMEOUT = 1.5
PUBLISH_TIMEOUT = 1.5
# At least connect + publish timeouts + 3 s: before each wave a batch's lease is made to
# outlast one publish at its worst and is extended to that when less is left
# (router.relay.lease), so a shorter lease_seconds would not be the lease in the database.
# Two seconds more, so the survivors have delivered every other stream, and are idle, when
# the killed host's leases end.
LEASE_SECONDS = 8.0
# Idle, a survivor must wake up for the rows when their leases end (not at
# outbox.poll_interval, a minute): on a busy two-core machine, give it 1.5 s.
TAKEOVER_WITHIN = LEASE_SECONDS + 1.5

HELD = """
    SELECT seq, stream_key, locked_until, extract(epoch FROM locked_until - now())::float8 AS left
    FROM router_outbox WHERE status = 'processing' AND locked_by LIKE $1
"""
PROGRESS = """
    SELECT count(*) FILTER (WHERE seq = ANY($1::bigint[]) AND status <> 'published'
                              AND NOT locked_by LIKE ANY($2)),
           count(*) FILTER (WHERE status <> 'published' AND stream_key <> ALL($3::text[]))
    FROM router_outbox
"""


@dataclass
class Takeover:
    """What the killed host held, and when (seconds after the kill) the survivors had
    delivered every other stream and had taken its rows over."""

    held: list[asyncpg.Record]
    idle: float | None = None
    took: float | None = None


async def test_the_other_hosts_take_a_killed_hosts_rows_over_as_its_leases_end(
    pg_url: str, nats_streams: NatsStreams, tmp_path: Path
) -> None:
    proxy = DelayingProxy("127.0.0.1", 4222, delay=ACK_DELAY)
    await proxy.start()
    target = nats_streams.stream("int")
    brokers = through(
        proxy, target, connect_timeout=CONNECT_TIMEOUT, publish_timeout=PUBLISH_TIMEOUT
    )
    hosts = {name: start_host(tmp_path / name, pg_url, brokers) for name in HOSTS}
    conn = await asyncpg.connect(pg_url)
    try:
        for serving in hosts.values():
            await both_ready(serving, timeout=30)
        await stage(pg_url, brokers, 0, TOTAL)
        # A worker connects to NATS at its first claim; once one has, what its host holds
        # is mostly published already, the acks on their way.
        for serving in hosts.values():
            await until(partial(connected, serving), 30, "connected to NATS", serving)
        await until_every_host_holds_leases(conn, timeout=15)
        takeover = await kill_and_take_over(conn, hosts[VICTIM])
        await assert_claimed_after_the_leases_ended(conn, takeover.held)
        await until_published(conn, [hosts[name] for name in SURVIVORS], timeout=60)
        arrived = await nats_streams.messages(target[0], TOTAL, timeout=10)
        repeats = assert_first_deliveries_in_order(arrived)
        resent = await published_by_the_dead_host(conn, takeover.held, arrived)
    finally:
        await conn.close()
        codes = {name: await asyncio.to_thread(s.stop, signal.SIGTERM) for name, s in hosts.items()}
        for serving in hosts.values():
            with contextlib.suppress(ProcessLookupError):  # a worker left behind by a failure
                os.killpg(serving.process.pid, signal.SIGKILL)
        await proxy.stop()
    left = sorted(r["left"] for r in takeover.held)
    print(
        f"\n{VICTIM} SIGKILLed holding {len(takeover.held)} rows, leases ending "
        f"{left[0]:.2f}-{left[-1]:.2f} s later (lease {LEASE_SECONDS} s); the other streams "
        f"done {takeover.idle:.2f} s after the kill; taken over {takeover.took:.2f} s after it; "
        f"repeats in the stream: {repeats}; published by {VICTIM} before it died and sent "
        f"again after the takeover (JetStream dropped them by message id): {resent}"
    )
    for name in SURVIVORS:
        assert codes[name] == 0, hosts[name].log.read_text()


def start_host(folder: Path, url: str, brokers: dict[str, Any]) -> Serving:
    """``router serve`` named after ``folder``, in a process group of its own, as on a host."""
    folder.mkdir()
    write_config(folder, url, brokers, outbox={"batch_size": BATCH, "lease_seconds": LEASE_SECONDS})
    env = {**POOL_ENV, "ROUTER_INSTANCE": folder.name}
    return Serving(folder, env, new_session=True)


def connected(serving: Serving) -> bool:
    """A worker of the host is connected to NATS."""
    return bool(log_events(serving, "nats.connected"))


async def until_every_host_holds_leases(conn: asyncpg.Connection, timeout: float) -> None:
    """Wait until a worker of each host holds rows (lease holders are ``instance:wN:...``)."""
    deadline = time.monotonic() + timeout
    holders: set[str] = set()
    while holders != set(HOSTS):
        assert time.monotonic() < deadline, f"only {sorted(holders)} held leases"
        await asyncio.sleep(0.01)
        rows = await conn.fetch(
            "SELECT DISTINCT locked_by FROM router_outbox WHERE status = 'processing'"
        )
        holders = {r["locked_by"].partition(":")[0] for r in rows}


async def kill_and_take_over(conn: asyncpg.Connection, victim: Serving) -> Takeover:
    """SIGKILL ``victim``'s process group, then wait until the survivors hold or have
    published every row it held; fails once TAKEOVER_WITHIN has passed, or if the survivors
    were still busy with other streams when its leases ended (a takeover nobody waited for)."""
    killed = await kill_host(victim)
    takeover = Takeover(await conn.fetch(HELD, f"{VICTIM}:%"))
    assert takeover.held, f"{VICTIM} held no rows when it was killed"
    seqs = [r["seq"] for r in takeover.held]
    streams = list({r["stream_key"] for r in takeover.held})
    survivors = [f"{name}:%" for name in SURVIVORS]
    while True:
        left, elsewhere = await conn.fetchrow(PROGRESS, seqs, survivors, streams)
        elapsed = time.monotonic() - killed
        if not elsewhere and takeover.idle is None:
            takeover.idle = elapsed
        if not left:
            takeover.took = elapsed
            break
        assert elapsed < TAKEOVER_WITHIN, (
            f"{left} of {len(seqs)} rows of {VICTIM} not taken over {elapsed:.1f} s after the "
            f"kill (lease {LEASE_SECONDS} s; the other streams done after {takeover.idle} s)"
        )
        await asyncio.sleep(0.02)
    ends = min(r["left"] for r in takeover.held)
    assert takeover.idle is not None and takeover.idle < ends, (
        f"the survivors were still busy when the leases ended ({ends:.2f} s after the kill)"
    )
    return takeover


async def kill_host(serving: Serving) -> float:
    """SIGKILL the router and its workers at once; returns when (monotonic), once all are gone."""
    group = serving.process.pid
    os.killpg(group, signal.SIGKILL)
    killed = time.monotonic()
    await asyncio.to_thread(serving.process.wait, 5)
    # The workers are reaped by whoever adopts them: count them gone once none runs.
    while any(pgrp == group and state not in "ZX" for state, pgrp in processes()):
        assert time.monotonic() - killed < 5, "the killed host's workers still run"
        await asyncio.sleep(0.01)
    return killed


def processes() -> list[tuple[str, int]]:
    """(state, process group) of every process."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # The command name, in parentheses, may hold spaces: fields count from its end.
            state, _ppid, pgrp = stat.read_text().rpartition(")")[2].split()[:3]
            found.append((state, int(pgrp)))
    return found


async def assert_claimed_after_the_leases_ended(
    conn: asyncpg.Connection, held: list[asyncpg.Record]
) -> None:
    """No survivor claimed a row of the dead host while its lease ran: a claim compares
    locked_until to now() and stamps last_attempt_at with that same now()."""
    ends = {r["seq"]: r["locked_until"] for r in held}
    rows = await conn.fetch(
        "SELECT seq, last_attempt_at FROM router_outbox WHERE seq = ANY($1::bigint[])", list(ends)
    )
    early = [r["seq"] for r in rows if r["last_attempt_at"] < ends[r["seq"]]]
    assert not early, f"rows claimed under a running lease: {early}"


async def until_published(
    conn: asyncpg.Connection, survivors: list[Serving], timeout: float
) -> None:
    """Wait until every row is published, the survivors running meanwhile."""
    deadline = time.monotonic() + timeout
    query = "SELECT count(*) FROM router_outbox WHERE status <> 'published'"
    while left := await conn.fetchval(query):
        for serving in survivors:
            assert serving.process.poll() is None, serving.log.read_text()
        assert time.monotonic() < deadline, f"{left} rows not published within {timeout} s"
        await asyncio.sleep(0.1)


def order_number(message: Any) -> int:
    """The n of event o-n."""
    return int(json.loads(message.data)["payload"]["order_id"][2:])


def assert_first_deliveries_in_order(messages: list[Any]) -> int:
    """Every event arrived and each stream's first deliveries are in order; returns the
    number of repeats, which at-least-once delivery allows."""
    numbers = [order_number(m) for m in messages]
    first = list(dict.fromkeys(numbers))
    assert sorted(first) == list(range(TOTAL))
    for key in range(STREAMS):
        of_stream = [n for n in first if stream(n) == stream(key)]
        assert of_stream == sorted(of_stream), f"{stream(key)} out of order: {of_stream}"
    return len(numbers) - len(first)


async def published_by_the_dead_host(
    conn: asyncpg.Connection, held: list[asyncpg.Record], messages: list[Any]
) -> int:
    """How many of the dead host's rows it had published: stored in the stream before a
    survivor claimed them again (the survivor's sending is then a repeat)."""
    stored: dict[int, datetime] = {}
    for message in messages:
        stored.setdefault(order_number(message), message.time)
    rows = await conn.fetch(
        "SELECT (envelope->'payload'->>'order_id') AS order_id, last_attempt_at "
        "FROM router_outbox WHERE seq = ANY($1::bigint[])",
        [r["seq"] for r in held],
    )
    return sum(stored[int(r["order_id"][2:])] < r["last_attempt_at"] for r in rows)
