"""``router serve --workers 2`` when a worker dies: its batch is queued again at once (its
connection closes and PostgreSQL rolls the batch back) and another worker goes on, it is
replaced at once, and one that cannot start is retried with a back-off capped at 2 s while
the other worker delivers."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml

from router import Outbox
from router.serve.forkserver import FORKSERVER_NAME, worker_pids
from tests.chaos.proxy import DelayingProxy
from tests.conftest import NatsStreams, batch_holder, make_config, nats_broker, pg_fetch
from tests.e2e.helpers import Serving
from tests.integration.events import OrderPlaced

STREAMS = 50
POOL_ENV = {"ROUTER_WORKERS": "2", "ROUTER_LOG_FORMAT": "json", "ROUTER_LOG_LEVEL": "info"}


# Imported by every process of the pool; it fails in worker 1 while the file "broken" lies
# next to it: a worker whose environment is broken (ROUTER_WORKER_INDEX is set for workers
# only, so the parent, which imports the events modules first, is not affected).
def write_config(folder: Path, url: str, brokers: dict[str, Any], **extra: Any) -> None:
    config = {
        "service": "shop",
        "databases": {"main": url},
        "brokers": brokers,
        "http": {"enabled": False},
        **extra,
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(config))


async def stage(url: str, brokers: dict[str, Any], start: int, count: int) -> None:
    """Events o-start.. o-(start+count-1), event i on stream s(i % STREAMS), interleaved."""
    outbox = Outbox(make_config({"main": url}, brokers))
    async with outbox.transaction() as tx:
        for i in range(start, start + count):
            await tx.stage(OrderPlaced(order_id=f"o-{i}", total=Decimal(i)), stream_key=stream(i))
    await outbox.close()


def stream(i: int) -> str:
    return f"s{i % STREAMS}"


def log_events(serving: Serving, name: str, **match: Any) -> list[dict[str, Any]]:
    """The JSON log lines of event ``name`` (with the given fields), in order."""
    found = []
    for line in serving.log.read_text().splitlines():
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        if record["event"] == name and all(record.get(k) == v for k, v in match.items()):
            found.append(record)
    return found


def at(record: dict[str, Any]) -> float:
    return datetime.fromisoformat(record["time"]).timestamp()


def proc(path: str) -> str:
    """A file of /proc, stripped."""
    return Path("/proc", path).read_text().strip()


async def both_ready(serving: Serving, timeout: float = 20) -> None:
    """Wait until both workers of the pool said they are ready."""
    await until(
        lambda: len(log_events(serving, "worker.ready")) == 2, timeout, "two workers ready", serving
    )


def through(proxy: DelayingProxy, target: tuple[str, str], **timeouts: float) -> dict[str, Any]:
    """The brokers of a config: the internal NATS broker of ``target``, through ``proxy``."""
    url = f"nats://127.0.0.1:{proxy.port}"
    return {"events": nats_broker(target, internal=True, url=url, **timeouts)}


async def until(check: Callable[[], bool], timeout: float, what: str, serving: Serving) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if serving.process.poll() is not None:
            raise AssertionError(f"router serve exited:\n{serving.log.read_text()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout} s:\n{serving.log.read_text()}")
        await asyncio.sleep(0.02)


def assert_in_order(messages: list[Any], total: int) -> None:
    """Every event exactly once (JetStream drops repeats by message id), each stream in order."""
    numbers = [int(json.loads(m.data)["payload"]["order_id"][2:]) for m in messages]
    assert sorted(numbers) == list(range(total))
    for key in range(STREAMS):
        of_stream = [n for n in numbers if n % STREAMS == key]
        assert of_stream == sorted(of_stream), f"stream s{key} out of order: {of_stream}"


async def test_a_killed_workers_rows_are_claimable_within_a_second(
    pg_url: str, nats_streams: NatsStreams, tmp_path: Path
) -> None:
    # Acks come back 1 s late: a worker holds its batch for at least that long.
    proxy = DelayingProxy("127.0.0.1", 4222, delay=1.0)
    await proxy.start()
    target = nats_streams.stream("int")
    brokers = through(proxy, target, connect_timeout=15, publish_timeout=10)
    total = 200
    await stage(pg_url, brokers, 0, total)
    write_config(tmp_path, pg_url, brokers, outbox={"batch_size": 10, "lease_seconds": 30})
    serving = Serving(tmp_path, POOL_ENV)
    try:
        # One batch of the target is in flight at a time; the other worker's claim waits.
        await both_ready(serving)
        deadline = time.monotonic() + 30
        while (victim := await batch_holder(pg_url, "events")) is None:
            assert time.monotonic() < deadline, serving.log.read_text()
            await asyncio.sleep(0.02)
        pid = int(victim.split(":")[2])  # host:wN:pid:random
        assert pid in worker_pids(serving.process.pid)

        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        # The victim's batch ends with its connection; the other worker's waiting claim
        # takes the rows at once (the lost lease_seconds of 30 s plays no part).
        while (holder := await batch_holder(pg_url, "events")) in (victim, None):
            assert time.monotonic() - killed < 5, serving.log.read_text()
            await asyncio.sleep(0.005)
        freed = time.monotonic() - killed
        print(f"\nSIGKILL -> batch claimed by the other worker: {freed * 1000:.0f} ms")
        assert freed < 1.0
        survivor = holder

        arrived = await nats_streams.messages(target[0], total, timeout=90)
        assert_in_order(arrived, total)
        # Every event arrived: what is left is the last batch's mark, a second behind its acks.
        deadline = time.monotonic() + 15
        unpublished = "SELECT seq FROM router_outbox WHERE status <> 'published'"
        while left := await pg_fetch(pg_url, unpublished):
            assert time.monotonic() < deadline, f"{len(left)} rows still not marked published"
            await asyncio.sleep(0.1)
    finally:
        code = await asyncio.to_thread(serving.stop, signal.SIGTERM)
        await proxy.stop()
    assert code == 0, serving.log.read_text()
    (reaped,) = log_events(serving, "worker.reaped", pid=pid)
    assert reaped["signal"] == "SIGKILL"
    assert reaped["worker_id"] == victim
    assert reaped["released"] == {"main": 0}  # nothing was left to give back
    assert reaped["restart_in"] == 0.0
    assert survivor is not None
    assert survivor.split(":")[2] != victim.split(":")[2]


async def test_a_worker_that_cannot_start_is_retried_with_a_capped_back_off(
    pg_url: str, nats_streams: NatsStreams, tmp_path: Path
) -> None:
    target = nats_streams.stream("int")
    brokers = {"events": nats_broker(target, internal=True)}
    write_config(tmp_path, pg_url, brokers)
    config = tmp_path / "config.yaml"
    good = config.read_text()
    serving = Serving(tmp_path, POOL_ENV)
    try:
        await both_ready(serving)
        # A worker reads the config as it starts: one restarted after the file broke cannot
        # start (a broken deploy), while the other runs on.
        config.write_text(good.replace("databases:", "databases: [", 1))
        (first,) = log_events(serving, "worker.ready", worker=1)
        os.kill(first["pid"], signal.SIGKILL)
        await until(
            lambda: len(log_events(serving, "worker.reaped", worker=1)) >= 3,
            15,
            "worker 1 failed twice",
            serving,
        )
        # Worker 0 delivers meanwhile, in order.
        await stage(pg_url, brokers, 0, 100)
        arrived = await nats_streams.messages(target[0], 100, timeout=10)
        assert_in_order(arrived, 100)
        assert not log_events(serving, "worker.reaped", worker=0)
        await until(
            lambda: len(log_events(serving, "worker.reaped", worker=1)) >= 7,
            30,
            "worker 1 failed six times",
            serving,
        )
        killed, *failed = log_events(serving, "worker.reaped", worker=1)
        starts = log_events(serving, "worker.started", worker=1)[1:]
        assert (killed["signal"], killed["ready"], killed["restart_in"]) == ("SIGKILL", True, 0.0)
        assert [r["restart_in"] for r in failed[:6]] == [0.25, 0.5, 1.0, 2.0, 2.0, 2.0]
        assert all(r["code"] == 2 and not r["ready"] for r in failed)
        # As the parent logged them: each start came its back-off after the failure before.
        gaps = [at(start) - at(reap) for reap, start in zip(failed, starts[1:], strict=False)]
        print(f"\nback-off seen (s): {[round(g, 2) for g in gaps]}")
        for gap, reap in zip(gaps, failed, strict=False):
            assert reap["restart_in"] - 0.05 <= gap <= reap["restart_in"] + 0.2
        assert max(gaps) <= 2.2

        # Mended: the next attempt becomes ready, and the back-off is over: when it dies
        # now, it is replaced at once.
        config.write_text(good)
        await until(
            lambda: len(log_events(serving, "worker.ready", worker=1)) == 2,
            10,
            "worker 1 ready",
            serving,
        )
        ready = log_events(serving, "worker.ready", worker=1)[-1]
        os.kill(ready["pid"], signal.SIGKILL)
        await until(
            lambda: bool(log_events(serving, "worker.reaped", pid=ready["pid"])),
            5,
            "worker 1 reaped",
            serving,
        )
        (last,) = log_events(serving, "worker.reaped", pid=ready["pid"])
        assert (last["signal"], last["ready"], last["restart_in"]) == ("SIGKILL", True, 0.0)
    finally:
        code = await asyncio.to_thread(serving.stop, signal.SIGTERM)
    assert code == 0, serving.log.read_text()


async def test_a_worker_that_dies_after_it_was_ready_is_replaced_at_once(
    pg_url: str, nats_streams: NatsStreams, tmp_path: Path
) -> None:
    target = nats_streams.stream("int")
    brokers = {"events": nats_broker(target, internal=True)}
    write_config(tmp_path, pg_url, brokers)
    serving = Serving(tmp_path, POOL_ENV)
    try:
        await both_ready(serving)
        parent = serving.process.pid
        before = worker_pids(parent)
        assert len(before) == 2
        victim = log_events(serving, "worker.ready", worker=0)[0]["pid"]
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        replaced = None
        while replaced is None:
            new = set(worker_pids(parent)) - set(before)
            if new:
                replaced = new.pop()
            else:
                assert time.monotonic() - killed < 5, serving.log.read_text()
                await asyncio.sleep(0.002)
        elapsed = time.monotonic() - killed
        await until(
            lambda: bool(log_events(serving, "worker.ready", pid=replaced)),
            20,
            "the new worker ready",
            serving,
        )
        ready_in = log_events(serving, "worker.ready", pid=replaced)[0]["seconds"]
        print(f"\nSIGKILL -> new worker process: {elapsed * 1000:.0f} ms, ready {ready_in} s later")
        assert elapsed < 0.5
        await stage(pg_url, brokers, 0, 40)
        assert_in_order(await nats_streams.messages(target[0], 40), 40)
    finally:
        code = await asyncio.to_thread(serving.stop, signal.SIGTERM)
    assert code == 0, serving.log.read_text()
    (reaped,) = log_events(serving, "worker.reaped", pid=victim)
    assert (reaped["signal"], reaped["ready"], reaped["restart_in"]) == ("SIGKILL", True, 0.0)
    assert reaped["released"] == {"main": 0}


async def test_workers_are_forked_children_of_the_pool_and_spawned_when_the_fork_server_is_gone(
    pg_url: str, nats_streams: NatsStreams, tmp_path: Path
) -> None:
    target = nats_streams.stream("int")
    brokers = {"events": nats_broker(target, internal=True)}
    write_config(tmp_path, pg_url, brokers)
    serving = Serving(tmp_path, POOL_ENV)
    try:
        await both_ready(serving)
        parent = serving.process.pid
        children = proc(f"{parent}/task/{parent}/children").split()
        names = {int(c): proc(f"{c}/comm") for c in children}
        # The workers are the parent's own children (re-parented from the fork server), named
        # as it is; the fork server is its child too, and the only one named so.
        (forkserver,) = [pid for pid, name in names.items() if name == FORKSERVER_NAME]
        workers = worker_pids(parent)
        assert sorted(workers) == sorted(p for p in names if p != forkserver)
        assert {r["pid"] for r in log_events(serving, "worker.ready")} == set(workers)
        assert {names[w] for w in workers} == {proc(f"{parent}/comm")}

        # Without its fork server the pool spawns `python -m router` instead, and goes on.
        os.kill(forkserver, signal.SIGKILL)
        os.kill(workers[0], signal.SIGKILL)
        await until(
            lambda: len(log_events(serving, "worker.ready")) == 3, 20, "a spawned worker", serving
        )
        assert log_events(serving, "forkserver.failed")
        await stage(pg_url, brokers, 0, 40)
        assert_in_order(await nats_streams.messages(target[0], 40), 40)
    finally:
        code = await asyncio.to_thread(serving.stop, signal.SIGTERM)
    assert code == 0, serving.log.read_text()
