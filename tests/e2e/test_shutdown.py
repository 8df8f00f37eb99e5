"""SIGTERM and SIGINT: finish the batch in flight, give back leases, exit 0; a start that
cannot complete ends at once, with one line and nothing left running."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from decimal import Decimal
from pathlib import Path

import asyncpg
import pytest
import yaml

from router import Outbox
from tests.chaos.proxy import DelayingProxy
from tests.conftest import NatsStreams, batch_in_flight, make_config, nats_broker
from tests.e2e.helpers import Serving, copy_default_config, router
from tests.integration.events import OrderPlaced
from tests.services import free_port, reachable


def write(folder: Path, config: dict[str, object]) -> None:
    (folder / "config.yaml").write_text(yaml.safe_dump(config))


async def counts(url: str) -> dict[tuple[str, str], int]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch(
            "SELECT target, status, count(*) FROM router_outbox GROUP BY target, status"
        )
    finally:
        await conn.close()
    return {(r[0], r[1]): r[2] for r in rows}


async def rows_of(url: str, target: str) -> list[tuple[object, ...]]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch(
            "SELECT status, attempts, locked_by FROM router_outbox WHERE target = $1", target
        )
    finally:
        await conn.close()
    return [tuple(r) for r in rows]


async def stage(url: str, brokers: dict[str, object], total: int) -> None:
    outbox = Outbox(make_config({"main": url}, brokers))
    for start in range(0, total, 500):
        async with outbox.transaction() as tx:
            await tx.stage(
                *(
                    OrderPlaced(order_id=f"o-{i}", total=Decimal(i))
                    for i in range(start, min(start + 500, total))
                )
            )
    await outbox.close()


async def test_sigterm_mid_backlog_leaves_no_row_in_flight_and_a_restart_finishes(
    pg_url: str, nats_streams: NatsStreams, tmp_path: Path
) -> None:
    # Acks 50 ms late: some 2,000 events a second, so the stop lands mid-backlog (a router
    # drains this backlog in well under a second otherwise).
    proxy = DelayingProxy("127.0.0.1", 4222, delay=0.05)
    await proxy.start()
    stream = nats_streams.stream("int")
    url = f"nats://127.0.0.1:{proxy.port}"
    brokers: dict[str, object] = {"events": nats_broker(stream, internal=True, url=url)}
    await stage(pg_url, brokers, 20_000)
    write(
        tmp_path,
        {
            "service": "shop",
            "databases": {"main": pg_url},
            "brokers": brokers,
            "outbox": {"batch_size": 200},
            "http": {"enabled": False},
        },
    )

    serving = Serving(tmp_path)
    await asyncio.to_thread(serving.wait_for, "router.started")
    # About half a second at the delayed acks' pace; 30 s covers a slow start.
    deadline = time.monotonic() + 30
    while (published := (await counts(pg_url)).get(("events", "published"), 0)) < 1000:
        assert time.monotonic() < deadline, (
            f"{published} of 1000 published\n{serving.log.read_text()}"
        )
        await asyncio.sleep(0.02)
    started = time.monotonic()
    code = await asyncio.to_thread(serving.stop, signal.SIGTERM)
    assert code == 0, serving.log.read_text()
    assert time.monotonic() - started < 5
    after_stop = await counts(pg_url)
    assert set(after_stop) == {("events", "published"), ("events", "pending")}
    assert after_stop[("events", "pending")] > 0, "stopped too late to test anything"
    # What was sent was marked, and what was marked was sent: nothing is left half done.
    published = after_stop[("events", "published")]
    sent = await nats_streams.messages(stream[0], published + 1, timeout=0.5)
    assert len(sent) == published

    again = Serving(tmp_path)
    try:
        arrived = await nats_streams.messages(stream[0], 20_000, timeout=60)
    finally:
        assert (await asyncio.to_thread(again.stop, signal.SIGINT)) == 0
        await proxy.stop()
    assert len(arrived) == 20_000
    assert await counts(pg_url) == {("events", "published"): 20_000}


async def test_a_hanging_partner_cannot_hold_shutdown_past_the_grace_period(
    pg_url: str, nats_streams: NatsStreams, tmp_path: Path
) -> None:
    hung: list[asyncio.StreamWriter] = []

    async def never_answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hung.append(writer)

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    internal, partner = nats_streams.stream("int"), nats_streams.stream("hang")
    brokers: dict[str, object] = {
        "events": nats_broker(internal, internal=True),
        "partner": nats_broker(
            partner, url=f"nats://127.0.0.1:{port}", connect_timeout=10, publish_timeout=10
        ),
    }
    await stage(pg_url, brokers, 10)
    write(
        tmp_path,
        {
            "service": "shop",
            "databases": {"main": pg_url},
            "brokers": brokers,
            "outbox": {"shutdown_grace_seconds": 1},
            "http": {"enabled": False},
        },
    )
    serving = Serving(tmp_path)
    try:
        await nats_streams.messages(internal[0], 10)
        deadline = time.monotonic() + 20  # the partner's first publish starts at once
        while not await batch_in_flight(pg_url, "partner"):  # all 10 rows: one batch
            assert time.monotonic() < deadline, (
                f"no partner batch in flight\n{serving.log.read_text()}"
            )
            await asyncio.sleep(0.05)
        started = time.monotonic()
        code = await asyncio.to_thread(serving.stop, signal.SIGTERM)
        elapsed = time.monotonic() - started
    finally:
        server.close()
        for writer in hung:
            writer.close()
    assert code == 0, serving.log.read_text()
    assert elapsed < 4, elapsed
    assert "batch.released" in serving.log.read_text()
    assert await rows_of(pg_url, "partner") == [("pending", 0, None)] * 10


def silent_nats(port: int, **extra: object) -> dict[str, object]:
    """A NATS broker at a listener that accepts connections and never answers."""
    return silent("nats", port, **extra)


def silent(kind: str, port: int, **extra: object) -> dict[str, object]:
    """A broker of ``kind`` at a listener that accepts connections and never answers."""
    where: dict[str, dict[str, object]] = {
        "nats": {
            "url": f"nats://127.0.0.1:{port}",
            "destination": "silent.{event_type}",
            "stream": {"name": "SILENT", "subjects": ["silent.>"], "storage": "memory"},
        },
        "rabbitmq": {
            "url": f"amqp://guest:guest@127.0.0.1:{port}/",
            "exchange": {"name": "silent", "type": "topic"},
            "destination": "{event_type}",
        },
        "kafka": {"bootstrap_servers": f"127.0.0.1:{port}", "destination": "silent"},
        "redis": {"url": f"redis://127.0.0.1:{port}/0", "destination": "silent"},
    }
    return {"type": kind, "internal": True, **where[kind], **extra}


@pytest.mark.parametrize("kind", ["nats", "rabbitmq", "kafka", "redis"])
async def test_sigterm_does_not_wait_for_a_connect_that_hangs(
    kind: str, pg_url: str, tmp_path: Path
) -> None:
    # Nothing is sent before the connection exists, so there is nothing to finish: the
    # grace period (10 s by default) is not spent on a connect that may take 30 s, and no
    # client library's reconnect loop outlives the stop.
    accepted: list[asyncio.StreamWriter] = []

    async def never_answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    await stage(pg_url, {"silent": silent(kind, port)}, 10)
    broker = silent(kind, port, connect_timeout=30, publish_timeout=5)
    write(
        tmp_path,
        {
            "service": "shop",
            "databases": {"main": pg_url},
            "brokers": {"silent": broker},
            "http": {"enabled": False},
        },
    )
    serving = Serving(tmp_path)
    try:
        deadline = time.monotonic() + 20
        while not accepted or not await batch_in_flight(pg_url, "silent"):
            assert time.monotonic() < deadline, (
                f"accepted {len(accepted)} connections, no batch in flight\n{serving.log.read_text()}"
            )
            await asyncio.sleep(0.05)
        started = time.monotonic()
        code = await asyncio.to_thread(serving.stop, signal.SIGTERM)
        elapsed = time.monotonic() - started
    finally:
        server.close()
        for writer in accepted:
            writer.close()
    assert code == 0, serving.log.read_text()
    assert elapsed < 2.5, (elapsed, serving.log.read_text())
    assert "Traceback" not in serving.log.read_text()
    assert await rows_of(pg_url, "silent") == [("pending", 0, None)] * 10


def test_a_taken_http_port_ends_serve_at_once_with_one_line(tmp_path: Path) -> None:
    config = yaml.safe_load(copy_default_config(tmp_path).read_text())
    nats_port = free_port()
    env = {
        "DATABASE_URL": "sqlite:///./var/shop.db",
        "NATS_URL": f"nats://127.0.0.1:{nats_port}",
        "PARTNER_NATS_URL": f"nats://127.0.0.1:{nats_port}",
    }
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        http_port = blocker.getsockname()[1]
        config["http"]["bind"] = f"127.0.0.1:{http_port}"
        write(tmp_path, config)
        assert router("init-db", cwd=tmp_path, env=env).returncode == 0
        # A hang would raise TimeoutExpired (and kill the process).
        served = router("serve", cwd=tmp_path, env=env, timeout=15)
    assert served.returncode == 1, served.stderr
    assert served.stderr.splitlines()[-1] == (
        f"router: http.bind 127.0.0.1:{http_port} is already in use; "
        "stop the other process or change http.bind"
    )
    assert "Traceback" not in served.stderr
    assert "nats.embedded.stopped" in served.stderr
    assert not reachable("127.0.0.1", nats_port)  # no embedded server left behind


def circuits(folder: Path) -> dict[str, str]:
    """``router status --json``: each target's circuit, as the operator reads it."""
    shown = router("status", "--json", cwd=folder)
    assert shown.returncode == 0, shown.stderr
    return {t["target"]: t["circuit"] for t in json.loads(shown.stdout)["targets"]}


async def serve_with_an_open_circuit(
    pg_url: str, nats_streams: NatsStreams, folder: Path
) -> Serving:
    """``router serve`` whose partner broker is down (nothing listens on its port), its
    circuit open at the first failure and probed every half second."""
    brokers: dict[str, object] = {
        "events": nats_broker(nats_streams.stream("int"), internal=True),
        "partner": nats_broker(
            nats_streams.stream("down"), url=f"nats://127.0.0.1:{free_port()}", connect_timeout=0.5
        ),
    }
    await stage(pg_url, brokers, 2)
    write(
        folder,
        {
            "service": "shop",
            "databases": {"main": pg_url},
            "brokers": brokers,
            "outbox": {"circuit": {"probe_max_delay": 0.5}},
            "http": {"enabled": False},
        },
    )
    serving = Serving(folder)
    await asyncio.to_thread(serving.wait_for, "circuit.opened")
    await asyncio.to_thread(serving.wait_for, "circuit.probe_failed")  # recorded by now
    return serving


async def test_sighup_stops_serve_gracefully_and_leaves_no_open_circuit_behind(
    pg_url: str, nats_streams: NatsStreams, tmp_path: Path
) -> None:
    serving = await serve_with_an_open_circuit(pg_url, nats_streams, tmp_path)
    try:
        assert circuits(tmp_path) == {"events": "closed", "partner": "open"}
    finally:
        code = await asyncio.to_thread(serving.stop, signal.SIGHUP)
    log = serving.log.read_text()
    assert code == 0, log
    assert "router.stopping signal=SIGHUP" in log
    assert "router.stopped" in log
    # Nobody's circuit is open once the process that opened it is gone.
    assert circuits(tmp_path) == {"events": "closed", "partner": "closed"}


async def test_a_killed_routers_open_circuit_shows_as_stale(
    pg_url: str, nats_streams: NatsStreams, tmp_path: Path
) -> None:
    serving = await serve_with_an_open_circuit(pg_url, nats_streams, tmp_path)
    try:
        assert circuits(tmp_path)["partner"] == "open"
        await asyncio.sleep(6)  # a live router keeps renewing it: still open
        assert circuits(tmp_path)["partner"] == "open"
    finally:
        assert await asyncio.to_thread(serving.stop, signal.SIGKILL) == -signal.SIGKILL
    # Not renewed for two of its longest probe gaps (2 x (0.5 x 1.2 + 2 x 0.5 + 1) = 5.2 s).
    await asyncio.sleep(6)
    assert circuits(tmp_path)["partner"] == "stale"
