"""router serve's HTTP endpoint: metrics and the status API agree with `router status`,
the token guards them, and the dashboard shows every target in headless Chromium."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import urllib.error
import urllib.request
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml

from router import Outbox
from tests.conftest import NatsStreams, make_config, nats_broker
from tests.e2e.helpers import Serving, router
from tests.integration.events import OrderPlaced
from tests.services import free_port, in_ci

TOKEN = "dashboard-t0ken-value"


def get(port: int, path: str, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


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
                    "circuit": {"open_after": 0},
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

        def partner_failed() -> bool:
            status, body = get(port, "/api/outbox", TOKEN)
            rows = {r["target"]: r for r in json.loads(body)["targets"]}
            return status in (200, 503) and rows["partner"]["failed"] == 10

        await until(partner_failed)

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
        assert sample(metrics, "router_failed_total", "partner") == 10
        assert sample(metrics, "router_waiting_retry", "partner") == rows["partner"]["failed"]
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
    assert '<div class="label">retrying</div><div class="value">10</div>' in dom
    assert "cannot connect to NATS" in dom  # the latest errors table
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
