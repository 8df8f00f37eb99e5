"""The console's POST routes: pausing and resuming a target over HTTP holds and frees its
delivery as ``router pause``/``router resume`` do, under ``router serve`` on PostgreSQL and on
SQLite; the routes are off without ``http.token``, need the bearer token, and refuse requests
a browser marks as coming from another site."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import yaml

from router import Outbox
from router.ops.audit import history
from tests.conftest import Database, make_config
from tests.e2e.helpers import Serving, router
from tests.e2e.test_http import BEARER, ON_EACH_DATABASE, TOKEN, console
from tests.integration.events import OrderPlaced
from tests.services import free_port

BROKERS: dict[str, Any] = {
    "events": {"type": "memory", "internal": True},
    "partner": {"type": "memory"},
}
ENV = {"ROUTER_HTTP_TOKEN": TOKEN}
PAUSE = "/api/targets/main/partner/pause"
RESUME = "/api/targets/main/partner/resume"


def serve(database: Database, port: int) -> Serving:
    """``router serve`` on ``database``, its console on ``port`` with the token."""
    (database.base_dir / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "service": "shop",
                "databases": {"main": database.url},
                "brokers": BROKERS,
                "http": {"bind": f"127.0.0.1:{port}", "token": "${ROUTER_HTTP_TOKEN}"},
            }
        )
    )
    serving = Serving(database.base_dir, ENV)
    try:
        serving.wait_for("router.started")
    except BaseException:
        serving.stop()
        raise
    return serving


def status(folder: Path) -> dict[str, dict[str, Any]]:
    """``router status --json``, by target."""
    result = router("status", "--json", cwd=folder, env=ENV)
    assert result.returncode == 0, result.stderr
    return {row["target"]: row for row in json.loads(result.stdout)["targets"]}


async def stage(database: Database, count: int) -> None:
    outbox = Outbox(make_config({"main": database.url}, BROKERS, database.base_dir))
    try:
        async with outbox.transaction() as tx:
            await tx.stage(
                *(OrderPlaced(order_id=f"o-{i}", total=Decimal(i)) for i in range(count))
            )
    finally:
        await outbox.close()


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 20) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("not reached in time")
        await asyncio.sleep(0.2)


async def served_paused(client: httpx.AsyncClient) -> dict[str, bool]:
    """GET /api/outbox: whether each target is paused."""
    response = await client.get("/api/outbox", headers=BEARER)
    assert response.status_code == 200, response.text
    return {row["target"]: row["paused"] for row in response.json()["targets"]}


@ON_EACH_DATABASE
async def test_pause_and_resume_over_http_hold_and_free_a_targets_delivery(
    database: Database,
) -> None:
    folder, port = database.base_dir, free_port()
    serving = serve(database, port)
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=10, trust_env=False
        ) as client:
            paused = await client.post(PAUSE, headers=BEARER)
            assert (paused.status_code, paused.json()) == (
                200,
                {"database": "main", "target": "partner", "paused": True},
            )
            assert await served_paused(client) == {"events": False, "partner": True}
            assert {
                t: r["paused"] for t, r in (await asyncio.to_thread(status, folder)).items()
            } == {
                "events": False,
                "partner": True,
            }

            await stage(database, 3)

            async def events_delivered() -> bool:
                rows = await asyncio.to_thread(status, folder)
                return bool(rows["events"]["published"] == 3)

            await until(events_delivered)
            held = (await asyncio.to_thread(status, folder))["partner"]
            assert (held["pending"], held["published"]) == (3, 0)

            resumed = await client.post(RESUME, headers=BEARER)
            assert (resumed.status_code, resumed.json()) == (
                200,
                {"database": "main", "target": "partner", "paused": False},
            )
            assert await served_paused(client) == {"events": False, "partner": False}

            async def partner_delivered() -> bool:
                rows = await asyncio.to_thread(status, folder)
                return rows["partner"]["published"] == 3 and not rows["partner"]["paused"]

            await until(partner_delivered)
            # SIGTERM while this client holds a kept-alive connection: serve still exits at once.
            started = time.monotonic()
            assert await asyncio.to_thread(serving.stop) == 0
            assert time.monotonic() - started < 5
    finally:
        serving.stop()
    trail = await history(make_config({"main": database.url}, BROKERS, folder))
    assert [(r.actor, r.action, r.target, r.detail["database"]) for r in trail] == [
        ("http:127.0.0.1", "resume", "partner", "main"),
        ("http:127.0.0.1", "pause", "partner", "main"),
    ]
    log = serving.log.read_text()
    assert "http.target_paused" in log
    assert "http.target_resumed" in log
    assert "uvicorn" not in log.lower()  # no access log, no start-up chatter


@ON_EACH_DATABASE
async def test_without_a_token_the_post_routes_are_off(database: Database) -> None:
    async with console(database, token=None) as (_, client):
        answers = [
            await client.post(path, headers=headers)
            for path in ("/api/targets/main/analytics/pause", "/api/targets/main/analytics/resume")
            for headers in ({}, BEARER)
        ]
        served = await served_paused(client)
    assert [(r.status_code, r.json()) for r in answers] == [
        (403, {"error": "mutating routes are off: set http.token"})
    ] * 4
    assert served == {"analytics": False, "billing": False, "events": False}


@ON_EACH_DATABASE
async def test_a_post_needs_the_bearer_token(database: Database) -> None:
    path = "/api/targets/main/analytics/pause"
    async with console(database) as (_, client):
        answers = [
            await client.post(path, headers=headers)
            for headers in (
                {},
                {"Authorization": "Bearer wrong"},
                {"Authorization": f"Basic {TOKEN}"},
                {"Authorization": TOKEN},
            )
        ]
        served = await served_paused(client)
    assert [(r.status_code, r.json()) for r in answers] == [
        (401, {"error": "a bearer token is required"})
    ] * 4
    assert served == {"analytics": False, "billing": False, "events": False}


@ON_EACH_DATABASE
async def test_a_post_from_another_site_is_refused(database: Database) -> None:
    path = "/api/targets/main/analytics/pause"
    async with console(database) as (server, client):
        foreign = [
            await client.post(path, headers={**BEARER, **headers})
            for headers in (
                {"Origin": "http://evil.example"},
                {"Origin": f"http://127.0.0.1:{server.port + 1}"},
                {"Origin": "null"},
                {"Sec-Fetch-Site": "cross-site"},
            )
        ]
        unchanged = await served_paused(client)
        own_site = await client.post(
            path,
            headers={
                **BEARER,
                "Origin": f"http://127.0.0.1:{server.port}",
                "Sec-Fetch-Site": "same-origin",
            },
        )
        changed = await served_paused(client)
    assert [r.status_code for r in foreign] == [403] * 4
    assert foreign[0].json() == {
        "error": "cross-site requests are refused (Origin http://evil.example is not this host)"
    }
    assert foreign[3].json() == {
        "error": "cross-site requests are refused (Sec-Fetch-Site: cross-site)"
    }
    assert unchanged == {"analytics": False, "billing": False, "events": False}
    assert (own_site.status_code, own_site.json()) == (
        200,
        {"database": "main", "target": "analytics", "paused": True},
    )
    assert changed == {"analytics": True, "billing": False, "events": False}


@ON_EACH_DATABASE
async def test_an_unknown_database_or_target_is_404_naming_it(database: Database) -> None:
    async with console(database) as (_, client):
        database_missing = await client.post("/api/targets/other/analytics/pause", headers=BEARER)
        target_missing = await client.post("/api/targets/main/nowhere/resume", headers=BEARER)
        get_instead = await client.get("/api/targets/main/analytics/pause", headers=BEARER)
    assert (database_missing.status_code, database_missing.json()) == (
        404,
        {"error": "unknown database 'other'"},
    )
    assert (target_missing.status_code, target_missing.json()) == (
        404,
        {"error": "database 'main' has no target 'nowhere'"},
    )
    assert (get_instead.status_code, get_instead.json()) == (
        405,
        {"error": "GET is not served on /api/targets/main/analytics/pause"},
    )
