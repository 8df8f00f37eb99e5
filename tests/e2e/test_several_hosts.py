"""Three ``router serve --workers 2`` on one PostgreSQL database, standing for three hosts. One
stops answering while its connections stay open (its process group is SIGSTOPped, as when a
host is cut off or frozen) in the middle of a batch. Nobody takes that batch's rows while its
session lives; a live worker's batch says it is there every half second, so the server ends
the silent session after two seconds (not ``lease_seconds``), and the other hosts go on with
the rows at once. When the host wakes up its batch is gone: it sends no
further wave and marks nothing, and every event arrives in the order of its stream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import asyncpg

from tests.chaos.proxy import DelayingProxy
from tests.conftest import NatsStreams, batch_holder
from tests.e2e.helpers import Serving
from tests.e2e.test_worker_recovery import (
    POOL_ENV,
    STREAMS,
    both_ready,
    log_events,
    stage,
    stream,
    through,
    write_config,
)

HOSTS = ("host-a", "host-b", "host-c")
TOTAL = 120  # 30 batches of 4, each held 0.5 s by the late acks
BATCH = 4
# Acks come back late: a host holds each batch at least this long, so the stop lands while
# the victim's batch is in flight.
ACK_DELAY = 0.5
# A NATS handshake through the proxy waits for two late answers (INFO, then PONG).
CONNECT_TIMEOUT = 1.5
PUBLISH_TIMEOUT = 1.5
# Longer than the server's idle limit for a batch's session (2 s, router.relay.store.postgres),
# so that limit, not the lease, is what the takeover waits for.
LEASE_SECONDS = 6.0
SILENT_SESSION = 2.0


async def test_a_silent_host_holds_its_batch_until_its_lease_and_no_longer(
    pg_url: str, nats_streams: NatsStreams, tmp_path: Path
) -> None:
    proxy = DelayingProxy("127.0.0.1", 4222, delay=ACK_DELAY)
    await proxy.start()
    target = nats_streams.stream("int")
    brokers = through(
        proxy, target, connect_timeout=CONNECT_TIMEOUT, publish_timeout=PUBLISH_TIMEOUT
    )
    hosts = {name: start_host(tmp_path / name, pg_url, brokers) for name in HOSTS}
    victim: Serving | None = None
    stopped = False
    try:
        for serving in hosts.values():
            await both_ready(serving, timeout=30)
        await stage(pg_url, brokers, 0, TOTAL)
        # Batches of the target take turns across all six workers: freeze the whole host of
        # the worker whose batch is in flight.
        deadline = time.monotonic() + 30
        while (holder := await batch_holder(pg_url, "events")) is None:
            assert time.monotonic() < deadline, "no batch in flight"
            await asyncio.sleep(0.005)
        name = holder.partition(":")[0]
        victim = hosts[name]
        os.killpg(victim.process.pid, signal.SIGSTOP)
        stopped, frozen = True, time.monotonic()
        # (The host's other worker may have taken the lock as the stop landed: frozen too.)
        while (now := await batch_holder(pg_url, "events") or name).startswith(name):
            assert time.monotonic() - frozen < SILENT_SESSION + 4, "no takeover"
            await asyncio.sleep(0.02)
        took = time.monotonic() - frozen
        # Not before the frozen session had been silent for its limit (its last heartbeat
        # came at most half a second before the stop), and not much after.
        assert SILENT_SESSION - 0.5 - 0.1 <= took <= SILENT_SESSION + 1.5, took

        os.killpg(victim.process.pid, signal.SIGCONT)  # it wakes up: its batch is gone
        stopped = False
        await until_published(pg_url, list(hosts.values()), timeout=60)
        arrived = await nats_streams.messages(target[0], TOTAL, timeout=10)
        repeats = assert_first_deliveries_in_order(arrived)
    finally:
        if stopped and victim is not None:
            os.killpg(victim.process.pid, signal.SIGCONT)
        codes = {name: await asyncio.to_thread(s.stop, signal.SIGTERM) for name, s in hosts.items()}
        for serving in hosts.values():
            with contextlib.suppress(ProcessLookupError):  # a worker left behind by a failure
                os.killpg(serving.process.pid, signal.SIGKILL)
        await proxy.stop()
    lost = [
        line
        for event in ("batch.session_lost", "batch.lease_lost", "batch.mark_failed")
        for line in log_events(victim, event)
    ]
    print(
        f"\n{holder} frozen mid-batch; {now} took over {took:.2f} s later (silent session"
        f" limit {SILENT_SESSION} s); repeats in the stream: {repeats}; the frozen host, awake, lost"
        f" its batch: {len(lost)} log lines"
    )
    assert lost, victim.log.read_text()  # it noticed, and wrote nothing
    for name, code in codes.items():
        assert code == 0, hosts[name].log.read_text()


def start_host(folder: Path, url: str, brokers: dict[str, Any]) -> Serving:
    """``router serve`` named after ``folder``, in a process group of its own, as on a host."""
    folder.mkdir()
    write_config(folder, url, brokers, outbox={"batch_size": BATCH, "lease_seconds": LEASE_SECONDS})
    env = {**POOL_ENV, "ROUTER_INSTANCE": folder.name}
    return Serving(folder, env, new_session=True)


async def until_published(url: str, hosts: list[Serving], timeout: float) -> None:
    """Wait until every row is published, the hosts running meanwhile."""
    deadline = time.monotonic() + timeout
    conn = await asyncpg.connect(url)
    try:
        query = "SELECT count(*) FROM router_outbox WHERE status <> 'published'"
        while left := await conn.fetchval(query):
            for serving in hosts:
                assert serving.process.poll() is None, serving.log.read_text()
            assert time.monotonic() < deadline, f"{left} rows not published within {timeout} s"
            await asyncio.sleep(0.1)
    finally:
        await conn.close()


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
