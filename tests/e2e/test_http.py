"""router serve's HTTP endpoint: metrics and the status API agree with `router status`,
the token guards them, and the dashboard shows every target in headless Chromium. Then the
console's own rules, on the real uvicorn server started in-process on port 0: which routes the
token guards, JSON errors, a failing route, the router's signals left alone, a quick stop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry

from brokers import PublishResult
from brokers.memory import MemoryBroker
from envelopes import RouterError
from router import Outbox
from router.serve.console import StatusService
from router.serve.http_app import HttpServer, build_app
from router.serve.runner import Runner
from tests.conftest import MEMORY_BROKERS, Database, NatsStreams, make_config, nats_broker
from tests.e2e.helpers import Serving, router
from tests.integration.events import OrderPlaced
from tests.services import free_port, in_ci, reachable

TOKEN = "dashboard-t0ken-value"
# The console's tests run on both kinds of database a newcomer and a service use.
ON_EACH_DATABASE = pytest.mark.parametrize("database", ["postgresql", "sqlite"], indirect=True)


def get(port: int, path: str, token: str | None = None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.get(
        f"http://127.0.0.1:{port}{path}", headers=headers, timeout=10, trust_env=False
    )
    return response.status_code, response.text


def sample(metrics: str, name: str, target: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + "{") and f'target="{target}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} for {target} not in metrics")


async def until(check: Any, timeout: float = 20) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await asyncio.to_thread(check):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("not reached in time")
        await asyncio.sleep(0.2)


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        message = "chromium is not installed (scripts/test installs Debian's package)"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)
    return found


async def serve_with_partner_down(
    pg_url: str, nats_streams: NatsStreams, folder: Path, port: int, **http: Any
) -> tuple[str, Serving]:
    """``router serve`` with a live internal broker and a partner on a closed port, after ten
    events were staged; returns the internal stream and the running router."""
    internal, partner = nats_streams.stream("int"), nats_streams.stream("ext")
    brokers: dict[str, Any] = {
        "events": nats_broker(internal, internal=True),
        "partner": nats_broker(partner, url=f"nats://127.0.0.1:{free_port()}", connect_timeout=0.5),
    }
    (folder / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "service": "shop",
                "databases": {"main": pg_url},
                "brokers": brokers,
                "outbox": {
                    "retry": {"base_delay": 60, "max_delay": 60},
                    "circuit": {"probe_max_delay": 3},
                },
                "http": {"bind": f"127.0.0.1:{port}", "token": "${ROUTER_HTTP_TOKEN}", **http},
            }
        )
    )
    outbox = Outbox(make_config({"main": pg_url}, brokers))
    async with outbox.transaction() as tx:
        await tx.stage(*(OrderPlaced(order_id=f"o-{i}", total=Decimal(i)) for i in range(10)))
    await outbox.close()
    serving = Serving(folder, {"ROUTER_HTTP_TOKEN": TOKEN})
    try:
        await asyncio.to_thread(serving.wait_for, "router.started")
    except BaseException:
        serving.stop()
        raise
    return internal[0], serving


def partner_circuit_open(port: int) -> bool:
    """/readyz (open to probes) lists the partner's circuit as open."""
    _, body = get(port, "/readyz")
    return bool(json.loads(body)["partner_circuits"].get("main/partner") == "open")


async def test_metrics_api_and_dashboard_show_what_status_shows(
    pg_url: str, nats_streams: NatsStreams, tmp_path: Path
) -> None:
    port = free_port()
    internal, serving = await serve_with_partner_down(pg_url, nats_streams, tmp_path, port)
    try:
        assert len(await nats_streams.messages(internal, 10)) == 10

        # Unreachable: no verdict on the rows, which wait untried behind the open circuit.
        def partner_waiting() -> bool:
            status, body = get(port, "/api/outbox", TOKEN)
            rows = {r["target"]: r for r in json.loads(body)["targets"]}
            return status in (200, 503) and rows["partner"]["pending"] == 10

        await until(partner_waiting)

        await until(lambda: partner_circuit_open(port))
        health_status, health = get(port, "/healthz")  # open: probes carry no token
        assert health_status == 200
        assert json.loads(health)["partner_circuits"] == {"main/partner": "open"}
        assert get(port, "/metrics")[0] == 401
        assert get(port, "/api/outbox", "wrong")[0] == 401
        # The internal broker delivers: a partner's outage leaves the router ready.
        ready_status, ready = get(port, "/readyz")
        assert (ready_status, json.loads(ready)) == (
            200,
            {
                "status": "ready",
                "database_error": None,
                "open_circuits": ["main/partner"],
                "partner_circuits": {"main/partner": "open"},
                "ready_requires_partners": False,
            },
        )

        status, metrics = get(port, "/metrics", TOKEN)
        assert status == 200
        api = json.loads(get(port, "/api/outbox", TOKEN)[1])
        table = json.loads(
            router("status", "--json", cwd=tmp_path, env={"ROUTER_HTTP_TOKEN": TOKEN}).stdout
        )

        rows = {r["target"]: r for r in table["targets"]}
        served = {r["target"]: r for r in api["targets"]}
        for target in ("events", "partner"):
            for figure in ("pending", "in_flight", "failed", "abandoned"):
                assert served[target][figure] == rows[target][figure], (target, figure)
        assert rows["events"]["published"] == 10
        # The API does not count published rows (a whole-table read on every poll): it says so.
        assert served["events"]["published"] is None
        assert '"published": null' in get(port, "/api/outbox", TOKEN)[1]
        assert served["events"]["since_start"]["published"] == 10
        assert sample(metrics, "router_published_total", "events") == 10
        assert sample(metrics, "router_commit_to_ack_seconds_count", "events") == 10
        assert rows["partner"]["failed"] == 0
        assert sample(metrics, "router_waiting_retry", "partner") == 0
        assert sample(metrics, "router_pending", "partner") == 10
        assert sample(metrics, "router_pending", "events") == rows["events"]["pending"]
        assert sample(metrics, "router_circuit_open", "partner") == 1
        assert sample(metrics, "router_circuit_open", "events") == 0
        assert rows["partner"]["circuit"] == "open"

        page, dom = await asyncio.to_thread(screenshot_dashboard, port, tmp_path)
    finally:
        serving.stop()
    assert 'data-target="main/events"' in dom
    assert 'data-target="main/partner"' in dom
    assert "circuit open" in dom
    assert "cannot connect to NATS" in dom, dom  # the open circuit's reason
    assert page.stat().st_size > 10_000


async def test_a_partners_open_circuit_fails_readiness_when_partners_are_required(
    pg_url: str, nats_streams: NatsStreams, tmp_path: Path
) -> None:
    port = free_port()
    _, serving = await serve_with_partner_down(
        pg_url, nats_streams, tmp_path, port, ready_requires_partners=True
    )
    try:
        await until(lambda: partner_circuit_open(port))
        ready_status, ready = get(port, "/readyz")
        health_status, health = get(port, "/healthz")
    finally:
        serving.stop()
    assert (ready_status, json.loads(ready)) == (
        503,
        {
            "status": "not ready",
            "database_error": None,
            "open_circuits": ["main/partner"],
            "partner_circuits": {"main/partner": "open"},
            "ready_requires_partners": True,
        },
    )
    assert health_status == 200
    assert json.loads(health)["partner_circuits"] == {"main/partner": "open"}


def screenshot_dashboard(port: int, folder: Path) -> tuple[Path, str]:
    """Open the dashboard in headless Chromium; return the screenshot and the DOM."""
    binary = chromium()
    url = f"http://127.0.0.1:{port}/#token={TOKEN}"
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        "--virtual-time-budget=8000",
    ]
    page = folder / "dashboard.png"
    profile = folder / "chromium-profile"
    subprocess.run(
        [
            binary,
            *flags,
            f"--user-data-dir={profile}",
            "--window-size=1280,860",
            f"--screenshot={page}",
            url,
        ],
        capture_output=True,
        timeout=90,
        check=True,
    )
    dom = subprocess.run(
        [binary, *flags, f"--user-data-dir={profile}", "--dump-dom", url],
        capture_output=True,
        text=True,
        timeout=90,
        check=True,
    ).stdout
    return page, dom


def a_health() -> dict[str, Any]:
    return {"worker": "test"}


@contextlib.asynccontextmanager
async def console(
    database: Database,
    *,
    token: str | None = TOKEN,
    health: Callable[[], dict[str, Any]] = a_health,
) -> AsyncIterator[tuple[HttpServer, httpx.AsyncClient]]:
    """The console of a router on ``database`` (memory brokers), served by the real uvicorn
    server on a port the system picks, and a client of it."""
    http = {"token": token} if token else {}
    config = make_config({"main": database.url}, MEMORY_BROKERS, database.base_dir, http=http)
    service = StatusService(config, CollectorRegistry(), health)
    server = HttpServer("127.0.0.1", 0, build_app(service))
    await server.start()
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{server.port}", timeout=10, trust_env=False
        ) as client:
            yield server, client
    finally:
        await server.stop()


BEARER = {"Authorization": f"Bearer {TOKEN}"}
PARTNER_CIRCUITS = {"main/analytics": "closed", "main/billing": "closed"}
GET_ROUTES = ["/", "/api/outbox", "/healthz", "/metrics", "/readyz"]
ROUTES = sorted(
    [
        *GET_ROUTES,
        *(f"/api/targets/{{database}}/{{target}}/{a}" for a in ("pause", "resume")),
        *("/api/groups", "/api/messages", "/api/messages/{message_id}", "/api/audit"),
        *(f"/api/groups/{{database}}/{{group_id}}/{a}" for a in ("requeue", "discard")),
        *("/api/held", "/api/held/{database}/{target}/release"),
    ]
)


@ON_EACH_DATABASE
async def test_the_token_guards_every_get_route_but_the_probes_and_the_page(
    database: Database,
) -> None:
    async with console(database) as (_, client):
        opened = {path: await client.get(path) for path in ("/healthz", "/readyz", "/")}
        refused = [
            await client.get(path, headers=headers)
            for path in ("/metrics", "/api/outbox")
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN})
        ]
        served = {path: await client.get(path, headers=BEARER) for path in GET_ROUTES}
        unknown = await client.get("/api/outbox/", headers=BEARER)
        unknown_without_token = await client.get("/nothing")
        wrong_method = await client.delete("/metrics", headers=BEARER)

    assert {path: r.status_code for path, r in opened.items()} == dict.fromkeys(opened, 200)
    assert opened["/healthz"].json() == {
        "status": "ok",
        "worker": "test",
        "partner_circuits": PARTNER_CIRCUITS,
    }
    assert opened["/readyz"].json() == {
        "status": "ready",
        "database_error": None,
        "open_circuits": [],
        "partner_circuits": PARTNER_CIRCUITS,
        "ready_requires_partners": False,
    }
    assert opened["/"].headers["content-type"] == "text/html; charset=utf-8"
    assert [(r.status_code, r.json()) for r in refused] == [
        (401, {"error": "a bearer token is required"})
    ] * 6
    assert {path: r.status_code for path, r in served.items()} == dict.fromkeys(GET_ROUTES, 200)
    assert served["/metrics"].headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "router_pending{" in served["/metrics"].text
    targets = served["/api/outbox"].json()["targets"]
    assert [(t["target"], t["paused"]) for t in targets] == [
        ("analytics", False),
        ("billing", False),
        ("events", False),
    ]
    # A path that is no route is 404 with or without the token, as before the token check.
    assert (unknown.status_code, unknown.json()) == (
        404,
        {"error": "no route /api/outbox/", "routes": ROUTES},
    )
    assert unknown_without_token.status_code == 404
    assert (wrong_method.status_code, wrong_method.json()) == (
        405,
        {"error": "DELETE is not served on /metrics"},
    )
    every = [*opened.values(), *refused, *served.values(), unknown, wrong_method]
    assert {r.headers["cache-control"] for r in every} == {"no-store"}
    assert {r.headers["content-type"] for r in [*refused, unknown, wrong_method]} == {
        "application/json"
    }


@ON_EACH_DATABASE
async def test_without_a_token_every_get_route_is_open(database: Database) -> None:
    async with console(database, token=None) as (_, client):
        served = {path: (await client.get(path)).status_code for path in GET_ROUTES}
    assert served == dict.fromkeys(GET_ROUTES, 200)


@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
async def test_a_failing_route_answers_500_and_the_console_goes_on(
    database: Database, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("the health reading failed")

    async with console(database, health=broken) as (_, client):
        failed = await client.get("/healthz")
        ready = await client.get("/readyz")
    assert (failed.status_code, failed.json()) == (500, {"error": "RuntimeError"})
    assert failed.headers["cache-control"] == "no-store"
    assert ready.status_code == 200
    logged = [r for r in caplog.records if r.getMessage() == "http.route_failed"]
    assert [(r.levelname, r.exc_info and r.exc_info[0]) for r in logged] == [
        ("ERROR", RuntimeError)
    ]
    assert not [r for r in caplog.records if r.name.startswith("uvicorn")]


@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
async def test_serving_leaves_the_routers_signal_handling_alone(database: Database) -> None:
    """``router serve`` stops on SIGTERM through ``loop.add_signal_handler``; uvicorn must
    neither take the signal over nor stop the console by itself when it comes."""
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stopping.set)
    try:
        before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        async with console(database) as (_, client):
            serving = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
            signal.raise_signal(signal.SIGTERM)
            await asyncio.wait_for(stopping.wait(), 5)
            await asyncio.sleep(0.3)  # uvicorn would look at its exit flag every 0.1 s
            after_signal = await client.get("/healthz")
        after = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
    assert serving == before
    assert after == before
    assert after_signal.status_code == 200


@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
async def test_stop_is_quick_with_open_keep_alive_and_idle_connections(
    database: Database,
) -> None:
    async with console(database) as (server, client):
        first = await client.get("/healthz")
        second = await client.get("/api/outbox", headers=BEARER)
        # One connection, kept alive by the server for both requests.
        assert "connection" not in first.headers
        assert {
            r.extensions["network_stream"].get_extra_info("client_addr") for r in (first, second)
        } == {first.extensions["network_stream"].get_extra_info("client_addr")}
        idle = socket.create_connection(("127.0.0.1", server.port))  # sends nothing
        half = socket.create_connection(("127.0.0.1", server.port))
        half.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # headers unfinished
        started = time.monotonic()
        await server.stop()
        took = time.monotonic() - started
        for sock in (idle, half):
            sock.settimeout(5)
            assert sock.recv(1024) == b""  # closed by the server
            sock.close()
        assert not reachable("127.0.0.1", server.port)
    assert took < 2


@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
async def test_a_taken_port_is_one_router_error_naming_http_bind(database: Database) -> None:
    async with console(database) as (server, _):
        second = HttpServer("127.0.0.1", server.port, server.app)
        with pytest.raises(RouterError) as raised:
            await second.start()
    assert str(raised.value) == (
        f"http.bind 127.0.0.1:{server.port} is already in use; "
        "stop the other process or change http.bind"
    )


def refusing_brokers() -> Callable[[str, Any], Any]:
    """Memory brokers: ``analytics`` refuses each message once (retryably) then takes it,
    ``billing`` rejects every message for good (abandoned at its first attempt)."""
    refused: set[str] = set()

    def once(message: Any) -> PublishResult | None:
        if message.wire.message_id in refused:
            return None
        refused.add(message.wire.message_id)
        return PublishResult.failed("busy, try again", retryable=True)

    def never(message: Any) -> PublishResult:
        return PublishResult.failed("schema rejected", retryable=False)

    handlers = {"analytics": once, "billing": never}

    def factory(name: str, settings: Any) -> MemoryBroker:
        return MemoryBroker(name, handler=handlers.get(name))

    return factory


@contextlib.asynccontextmanager
async def serving_console(database: Database) -> AsyncIterator[httpx.AsyncClient]:
    """A router with its console (memory brokers as ``refusing_brokers`` says), and a client."""
    port = free_port()
    config = make_config(
        {"main": database.url},
        MEMORY_BROKERS,
        database.base_dir,
        http={"bind": f"127.0.0.1:{port}", "token": TOKEN},
        outbox={"retry": {"base_delay": 0.05, "max_delay": 0.05, "jitter": 0}},
    )
    runner = Runner(
        config, broker_factory=refusing_brokers(), start_embedded=False, run_cleanup=False
    )
    await runner.start()
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", headers=BEARER, timeout=10, trust_env=False
        ) as client:
            yield client
    finally:
        await runner.shutdown()


async def outbox_targets(client: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
    """/api/outbox's targets by name."""
    response = await client.get("/api/outbox")
    assert response.status_code == 200, response.text
    return {row["target"]: row for row in response.json()["targets"]}


@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
async def test_abandoned_rows_make_a_target_unhealthy_and_retries_follow_the_metric(
    database: Database,
) -> None:
    started = time.monotonic()  # before the console started
    async with serving_console(database) as client:
        opened = time.monotonic()  # after the console started
        # Every counter of every target has a sample from the start, at 0.
        metrics = (await client.get("/metrics")).text
        for target in MEMORY_BROKERS:
            assert sample(metrics, "router_rate_limited_seconds_total", target) == 0
            assert sample(metrics, "router_retried_total", target) == 0
        quiet = await outbox_targets(client)
        assert {name: row["healthy"] for name, row in quiet.items()} == dict.fromkeys(
            MEMORY_BROKERS, True
        )

        outbox = database.outbox()
        try:
            async with outbox.transaction() as tx:
                await tx.stage(*(OrderPlaced(order_id=f"o-{i}", total=Decimal(i)) for i in (1, 2)))
        finally:
            await outbox.close()

        async def settled() -> bool:
            rows = await outbox_targets(client)
            done = rows["analytics"]["since_start"].get("published") == 2
            return done and bool(rows["billing"]["abandoned"] == 2)

        deadline = time.monotonic() + 10
        while not await settled():
            assert time.monotonic() < deadline, await outbox_targets(client)
            await asyncio.sleep(0.1)
        last_read = time.monotonic()
        rows = await outbox_targets(client)
        finished = time.monotonic()

    billing, analytics = rows["billing"], rows["analytics"]
    # Two rows abandoned at their first attempt: not healthy, and never retried.
    assert billing["healthy"] is False
    assert billing["since_start"]["retried"] == 0
    assert billing["retries_per_minute"] == 0
    # Each analytics row was tried twice: two retries since start, and retries/min is
    # router_retried_total's increase over the time since the console started.
    assert analytics["healthy"] is True
    assert analytics["since_start"]["retried"] == 2
    since_start = (last_read - opened, finished - started)
    assert 2 * 60 / since_start[1] <= analytics["retries_per_minute"] <= 2 * 60 / since_start[0]
