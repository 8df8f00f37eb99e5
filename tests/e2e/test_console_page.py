"""The console page (``/``) in headless Chromium, driven by Playwright, on PostgreSQL and SQLite.

``router serve`` fails rows against a NATS partner where nothing listens (two others were
rejected a day ago); from the page an operator sees the targets, pauses the partner, requeues
one failure group after an in-page confirm that shows the dry run's count, pages through the
message browser, opens one message as each target received it, and reads the audit trail.
A console with no ``http.token`` shows its actions disabled. Each run takes the screenshots;
``UPDATE_SCREENSHOTS=1`` copies the PostgreSQL run's into docs/.

Playwright drives Debian's ``chromium`` (never ``playwright install``); under CI a missing
browser fails the test (``tests.e2e.test_http.chromium``).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import yaml
from playwright.async_api import Browser, Page, ViewportSize, async_playwright, expect

from router import Outbox
from router.ops.schema import outbox as outbox_table
from tests.conftest import Database, NatsStreams, make_config, nats_broker
from tests.e2e.helpers import Serving
from tests.e2e.test_console_api import console
from tests.e2e.test_http import ON_EACH_DATABASE, chromium
from tests.integration.events import OrderPlaced, StockReserved
from tests.services import free_port

TOKEN = "console-page-t0ken-value"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
DOCS = Path(__file__).resolve().parents[2] / "docs"
VIEWPORT: ViewportSize = {"width": 1280, "height": 860}
REJECTED = "rejected by JetStream: maximum payload exceeded (code 400, err_code 10054)"
# The partner is down for good: each row fails once, then waits an hour for its next try.
RETRY = {"max_attempts": 3, "base_delay": 3600, "max_delay": 3600}
# Untrusted text the page must show as text: a stream key and an event's payload.
MARKUP_KEY = '<img src=x id="injected-key">'
MARKUP_NOTE = '<script id="injected-note">window.injected = true</script>'


@dataclass(frozen=True)
class Staged:
    """What was staged: orders o-0..o-5 (to both targets, o-4 and o-5 rejected by the
    partner a day ago, the others refused by it now) and two StockReserved (internal only)."""

    orders: list[str]
    stock: list[str]

    @property
    def refused(self) -> list[str]:
        return self.orders[:4]

    @property
    def rejected(self) -> list[str]:
        return self.orders[4:]


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    """Debian's Chromium, headless, under Playwright."""
    binary = chromium()
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=binary, args=["--no-sandbox"])
        try:
            yield launched
        finally:
            await launched.close()


async def open_console(browser: Browser, url: str) -> tuple[Page, list[str]]:
    """A fresh browser profile on ``url`` at 1280x860; the list fills with the page's errors."""
    context = await browser.new_context(viewport=VIEWPORT)
    page = await context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    await page.goto(url)
    return page, errors


async def stage(database: Database, brokers: dict[str, Any]) -> Staged:
    """Stage the events, and mark the partner's rows of o-4 and o-5 rejected a day ago."""
    outbox = Outbox(make_config({"main": database.url}, brokers, database.base_dir))
    try:
        async with outbox.transaction() as tx:
            orders = await tx.stage(
                *(
                    OrderPlaced(order_id=f"o-{i}", total=Decimal(i), note=MARKUP_NOTE)
                    for i in range(6)
                ),
                stream_keys=[f"order-{i}" for i in range(6)],
            )
            stock = await tx.stage(
                *(StockReserved(order_id=f"o-{i}", quantity=i + 1) for i in range(2)),
                stream_keys=[MARKUP_KEY, "stock-1"],
            )
    finally:
        await outbox.close()
    staged = Staged(orders, stock)
    o = outbox_table
    await database.execute(
        sa.update(o)
        .where(o.c.target == "partner", o.c.message_id.in_(staged.rejected))
        .values(
            status="abandoned",
            attempts=1,
            last_error=f"not retryable: {REJECTED}",
            last_attempt_at=datetime.now(UTC) - timedelta(days=1),
        )
    )
    return staged


async def refuse(database: Database, message_ids: list[str]) -> None:
    """The partner's rows of ``message_ids`` as a retryable refusal leaves them: failed after
    one attempt, their retry an hour away."""
    o = outbox_table
    now = datetime.now(UTC)
    await database.execute(
        sa.update(o)
        .where(o.c.target == "partner", o.c.message_id.in_(message_ids))
        .values(
            status="failed",
            attempts=1,
            last_error="partner: cannot connect to NATS: ConnectionRefusedError: refused",
            first_attempt_at=now,
            last_attempt_at=now,
            available_at=now + timedelta(hours=1),
        )
    )


def serve(database: Database, brokers: dict[str, Any], port: int) -> Serving:
    """``router serve`` on ``database`` with the token, its console on ``port``."""
    (database.base_dir / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "service": "shop",
                "databases": {"main": database.url},
                "brokers": brokers,
                "outbox": {"retry": RETRY, "circuit": {"probe_max_delay": 3}},
                "http": {"bind": f"127.0.0.1:{port}", "token": "${ROUTER_HTTP_TOKEN}"},
            }
        )
    )
    serving = Serving(database.base_dir, {"ROUTER_HTTP_TOKEN": TOKEN})
    try:
        serving.wait_for("router.started")
    except BaseException:
        serving.stop()
        raise
    return serving


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 20) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("not reached in time")
        await asyncio.sleep(0.2)


async def get(client: httpx.AsyncClient, path: str, **params: Any) -> Any:
    response = await client.get(path, params=params, headers=BEARER)
    assert response.status_code in (200, 503), response.text
    return response.json()


async def targets(client: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
    """GET /api/outbox, by target."""
    return {row["target"]: row for row in (await get(client, "/api/outbox"))["targets"]}


async def message_ids(client: httpx.AsyncClient, **filters: str) -> list[str]:
    document = await get(client, "/api/messages", limit=200, **filters)
    return sorted(entry["message_id"] for entry in document["messages"])


async def screenshot(page: Page, database: Database, name: str) -> None:
    """console-<name>.png beside the test's database, checked to be a picture; into docs/
    as well from the PostgreSQL run when ``UPDATE_SCREENSHOTS=1`` (the README shows them; a
    plain test run leaves the checkout as it was)."""
    taken = await page.screenshot(path=database.base_dir / f"console-{name}.png")
    assert taken.startswith(b"\x89PNG") and len(taken) > 10_000
    if database.kind == "postgresql" and os.environ.get("UPDATE_SCREENSHOTS") == "1":
        (DOCS / f"console-{name}.png").write_bytes(taken)


@ON_EACH_DATABASE
async def test_an_operator_pauses_requeues_and_browses_from_the_page(
    database: Database, nats_streams: NatsStreams, browser: Browser
) -> None:
    internal = nats_streams.stream("int")
    brokers: dict[str, Any] = {
        "events": nats_broker(internal, internal=True),
        "partner": nats_broker(
            nats_streams.stream("ext"),
            url=f"nats://127.0.0.1:{free_port()}",
            connect_timeout=0.5,
        ),
    }
    staged = await stage(database, brokers)
    port = free_port()
    serving = await asyncio.to_thread(serve, database, brokers, port)
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=10, trust_env=False) as client:

            async def settled(failed: int) -> bool:
                rows = await targets(client)
                partner, events = rows.get("partner", {}), rows.get("events", {})
                return bool(
                    partner.get("failed") == failed
                    and partner.get("circuit") == "open"
                    and events.get("pending") == 0
                    and events.get("in_flight") == 0
                )

            # The unreachable partner costs the rows no attempt: they wait behind its open
            # circuit. The four refused orders get what a retryable refusal leaves.
            await until(lambda: settled(0))
            await refuse(database, staged.refused)
            await until(lambda: settled(4))
            await operate(database, staged, client, browser, base, internal[0])
    finally:
        serving.stop()


@dataclass(frozen=True)
class Console:
    """A page of the console with the token, and an API client of the same router."""

    page: Page
    client: httpx.AsyncClient
    database: Database
    staged: Staged


async def operate(
    database: Database,
    staged: Staged,
    client: httpx.AsyncClient,
    browser: Browser,
    base: str,
    internal_stream: str,
) -> None:
    page, errors = await open_console(browser, f"{base}/#token={TOKEN}")
    # The token moved from the URL into the browser's storage.
    assert page.url == f"{base}/"
    console = Console(page, client, database, staged)
    await see_the_targets_and_pause_the_partner(console)
    await requeue_the_group_of_refused_rows(console)
    await browse_the_messages(console)
    await open_one_message(console, internal_stream)
    await read_the_audit_trail(console)
    await ask_a_browser_without_the_token_for_it(browser, base)
    assert errors == []


async def see_the_targets_and_pause_the_partner(console: Console) -> None:
    page, client = console.page, console.client
    partner = page.locator('[data-testid="target"][data-target="main/partner"]')
    events = page.locator('[data-testid="target"][data-target="main/events"]')
    await expect(partner.locator('[data-figure="retrying"] .value')).to_have_text("4")
    await expect(partner.locator('[data-figure="abandoned"] .value')).to_have_text("2")
    # Abandoned rows wait for an operator: a badge of their own, never "ok".
    await expect(partner.get_by_test_id("state")).to_have_text(["circuit open", "2 abandoned"])
    await expect(partner.get_by_test_id("last-error")).to_contain_text("cannot connect to NATS")
    await expect(events.get_by_test_id("state")).to_have_text("ok")
    await expect(events.locator('[data-figure="since start"] .value')).to_have_text("8")
    await expect(page.get_by_test_id("actions-off")).to_be_hidden()
    await expect(page.get_by_test_id("tab-groups")).to_contain_text("2")  # two groups
    await expect(events.locator("svg polyline").first).to_be_attached()  # two polls drawn
    await screenshot(page, console.database, "targets")

    await partner.get_by_test_id("pause").click()
    await expect(page.get_by_test_id("notice-text")).to_have_text("Paused main/partner")
    await expect(partner.get_by_test_id("resume")).to_be_visible()
    await expect(partner.get_by_test_id("state")).to_have_text(
        ["paused", "circuit open", "2 abandoned"]
    )
    served = await targets(client)
    assert (served["partner"]["paused"], served["events"]["paused"]) == (True, False)


async def requeue_the_group_of_refused_rows(console: Console) -> None:
    """The partner is paused, so the requeued rows stay pending."""
    page, client, staged = console.page, console.client, console.staged
    groups = (await get(client, "/api/groups"))["groups"]
    assert sorted(g["count"] for g in groups) == [2, 4]
    down = next(g for g in groups if g["count"] == 4)
    bounced = next(g for g in groups if g["count"] == 2)
    await page.get_by_test_id("tab-groups").click()
    down_row = page.locator(f'[data-testid="group-row"][data-group="{down["id"]}"]')
    bounced_row = page.locator(f'[data-testid="group-row"][data-group="{bounced["id"]}"]')
    await expect(page.get_by_test_id("group-row")).to_have_count(2)
    await expect(down_row.get_by_test_id("group-count")).to_have_text("4")
    await expect(down_row).to_contain_text("ConnectionRefusedError")
    await expect(bounced_row.get_by_test_id("group-count")).to_have_text("2")

    await down_row.get_by_test_id("requeue").click()
    confirm = page.get_by_test_id("confirm")
    await expect(confirm).to_be_visible()
    await expect(confirm.get_by_test_id("confirm-text")).to_have_text("Requeue 4 rows?")
    await screenshot(page, console.database, "groups")
    # Asking for the count changed nothing.
    assert await message_ids(client, target="partner", status="failed") == sorted(staged.refused)

    await confirm.get_by_test_id("confirm-yes").click()
    await expect(confirm).to_be_hidden()
    await expect(down_row).to_have_count(0)
    await expect(page.get_by_test_id("group-row")).to_have_count(1)
    await expect(bounced_row.get_by_test_id("group-count")).to_have_text("2")
    await expect(page.get_by_test_id("notice-text")).to_contain_text("Requeued 4 rows")
    assert await message_ids(client, target="partner", status="pending") == sorted(staged.refused)
    assert await message_ids(client, target="partner", status="failed") == []


async def browse_the_messages(console: Console) -> None:
    """14 rows, paged by ten, then filtered by status."""
    page = console.page
    await page.get_by_test_id("tab-messages").click()
    rows = page.get_by_test_id("message-row")
    await expect(rows).to_have_count(14)
    # Untrusted text shows as text, never as markup.
    await expect(page.get_by_text(MARKUP_KEY, exact=True)).to_have_count(1)
    assert await page.locator("#injected-key").count() == 0
    await page.get_by_test_id("search-limit").select_option("10")
    await page.get_by_test_id("search-submit").click()
    await expect(rows).to_have_count(10)
    await page.get_by_test_id("next-page").click()
    await expect(rows).to_have_count(4)
    await expect(page.get_by_test_id("next-page")).to_be_disabled()
    await page.get_by_test_id("search-status").select_option("pending")
    await page.get_by_test_id("search-submit").click()
    await expect(rows).to_have_count(4)
    await expect(rows.filter(has_text="main/partner")).to_have_count(4)


async def open_one_message(console: Console, internal_stream: str) -> None:
    """Found by a prefix of its id: a row per target; its detail, a section per target."""
    page, chosen = console.page, console.staged.rejected[0]
    rows = page.get_by_test_id("message-row")
    await page.get_by_test_id("search-status").select_option("")
    await page.get_by_test_id("search-id").fill(chosen[:28])
    await page.get_by_test_id("search-submit").click()
    await expect(rows).to_have_count(2)
    await expect(rows.filter(has_text=chosen)).to_have_count(2)
    await rows.filter(has_text="main/partner").click()
    detail = page.get_by_test_id("message-detail")
    await expect(detail.get_by_test_id("detail-id")).to_have_text(chosen)
    sections = detail.get_by_test_id("message-target")
    await expect(sections).to_have_count(2)
    delivered = sections.and_(page.locator('[data-target="main/events"]'))
    refused = sections.and_(page.locator('[data-target="main/partner"]'))
    await expect(delivered.locator(".badge")).to_have_text("published")
    await expect(delivered.get_by_test_id("receipt")).to_contain_text(internal_stream)
    await expect(delivered.get_by_test_id("target-error")).to_have_text("-")
    await expect(refused.locator(".badge")).to_have_text("abandoned")
    await expect(refused.get_by_test_id("receipt")).to_have_text("-")
    await expect(refused.get_by_test_id("target-error")).to_contain_text("maximum payload exceeded")
    await expect(refused.get_by_test_id("message-headers")).to_contain_text(chosen)
    # The details `router preview` shows: the adapter's own header, the stream it goes to.
    await expect(refused.get_by_test_id("message-headers")).to_contain_text("Nats-Msg-Id")
    await expect(refused.get_by_test_id("message-binding")).to_contain_text("_EXT")
    body = refused.get_by_test_id("message-body")
    await expect(body).to_contain_text('"order_id": "o-4"')
    await expect(body).to_contain_text(f'"note": {json.dumps(MARKUP_NOTE)}')
    assert await page.locator("#injected-note").count() == 0
    assert await page.evaluate("window.injected === undefined")
    await screenshot(page, console.database, "message")


async def read_the_audit_trail(console: Console) -> None:
    page = console.page
    await page.get_by_test_id("tab-audit").click()
    actions = page.get_by_test_id("audit-row")
    await expect(actions).to_have_count(2)
    await expect(actions.nth(0)).to_contain_text("requeue")
    await expect(actions.nth(1)).to_contain_text("pause")
    await expect(actions.nth(0)).to_contain_text("http:127.0.0.1")


async def ask_a_browser_without_the_token_for_it(browser: Browser, base: str) -> None:
    page, errors = await open_console(browser, f"{base}/")
    await expect(page.get_by_test_id("token-form")).to_be_visible()
    await page.locator("#token-input").fill(TOKEN)
    await page.get_by_role("button", name="Use", exact=True).click()
    await expect(page.get_by_test_id("token-form")).to_be_hidden()
    partner = page.locator('[data-testid="target"][data-target="main/partner"]')
    await expect(partner.get_by_test_id("resume")).to_be_enabled()
    assert errors == []


@ON_EACH_DATABASE
async def test_without_a_token_the_page_shows_its_actions_disabled(
    database: Database, browser: Browser
) -> None:
    brokers: dict[str, Any] = {
        "events": {"type": "memory", "internal": True},
        "partner": {"type": "memory"},
    }
    await stage(database, brokers)
    config = make_config({"main": database.url}, brokers, base_dir=database.base_dir)
    async with console(config, token=None) as (server, client):
        refused = await client.post("/api/targets/main/partner/pause", json={})
        page, errors = await open_console(browser, f"http://127.0.0.1:{server.port}/")
        partner = page.locator('[data-testid="target"][data-target="main/partner"]')
        await expect(partner.locator('[data-figure="abandoned"] .value')).to_have_text("2")
        # Nothing else is wrong with the partner, but its abandoned rows make it no "ok".
        await expect(partner.get_by_test_id("state")).to_have_text("2 abandoned")
        await expect(partner.locator(".badge.abandoned")).to_be_visible()
        events = page.locator('[data-testid="target"][data-target="main/events"]')
        await expect(events.get_by_test_id("state")).to_have_text("ok")
        await expect(page.get_by_test_id("actions-off")).to_have_text(
            "actions are off: set http.token to enable actions"
        )
        await expect(page.get_by_test_id("pause")).to_have_count(2)
        for button in await page.get_by_test_id("pause").all():
            await expect(button).to_be_disabled()
        await page.get_by_test_id("tab-groups").click()
        await expect(page.get_by_test_id("group-row")).to_have_count(1)
        await expect(page.get_by_test_id("requeue")).to_be_disabled()
        await expect(page.get_by_test_id("discard")).to_be_disabled()
        # Reading still works: the message browser lists every row.
        await page.get_by_test_id("tab-messages").click()
        await expect(page.get_by_test_id("message-row")).to_have_count(14)
    assert refused.status_code == 403, refused.text
    assert json.loads(refused.text)["error"] == "mutating routes are off: set http.token"
    assert errors == []
