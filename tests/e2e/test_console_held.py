"""Held and parked stream keys in the console, on PostgreSQL, SQLite and MariaDB: ``GET
/api/held`` lists them as ``router held`` does, and ``POST /api/held/{database}/{target}/release``
releases one as ``router release`` does, audited as ``http:<client>``; a body that is not what
it should be changes nothing. On the page (headless Chromium), an operator finds the key on the
Held keys tab and releases it, with a reason."""

from __future__ import annotations

import pytest
from playwright.async_api import Browser, expect

from router.ops.held import held_keys
from tests.conftest import Database
from tests.e2e.test_console_api import BEARER, TOKEN, console, get
from tests.e2e.test_console_page import browser, open_console
from tests.integration.test_held import config_of, keep_the_second, opened, rows, stage

RELEASE = "/api/held/main/events/release"
__all__ = ["browser"]  # the page test's fixture, used here too


@pytest.mark.parametrize("kept", ["held", "parked"])
async def test_a_held_key_is_listed_and_released_over_http(database: Database, kept: str) -> None:
    await stage(database, 1, 2, 3)
    config = config_of(database)
    async with opened(database) as store:
        second = (await keep_the_second(database, store, kept))["2"]
    async with console(config) as (_, client):
        [key] = (await get(client, "/api/held"))["keys"]
        assert (key["target"], key["stream_key"], key["status"]) == ("events", "k", kept)
        assert key["message_id"] == second.message_id
        assert key["behind"] == 1  # 3, behind its head
        [same] = (await get(client, "/api/held", target="events", database="main"))["keys"]
        assert same | {"age_seconds": None} == key | {"age_seconds": None}

        refused = [
            await client.post(RELEASE, json={"stream_key": "k"}, headers=BEARER),
            await client.post(RELEASE, json={"stream_key": "k", "reason": " "}, headers=BEARER),
            await client.post(
                RELEASE, json={"stream_key": "k", "reason": "x", "drop": "yes"}, headers=BEARER
            ),
            await client.post(
                RELEASE, json={"stream_key": "k", "reason": "x", "dropp": True}, headers=BEARER
            ),
            await client.post(RELEASE, json={"stream_key": "nope", "reason": "x"}, headers=BEARER),
            await client.post(
                "/api/held/main/nope/release",
                json={"stream_key": "k", "reason": "x"},
                headers=BEARER,
            ),
            await client.post(
                "/api/held/other/events/release",
                json={"stream_key": "k", "reason": "x"},
                headers=BEARER,
            ),
            await client.post(RELEASE, json={"stream_key": "k", "reason": "x"}),  # no token
        ]
        assert [r.status_code for r in refused] == [400, 400, 400, 400, 404, 404, 404, 401]
        assert "neither held nor parked" in refused[4].json()["error"]
        assert len(await held_keys(config)) == 1, "a refused release changes nothing"

        released = await client.post(
            RELEASE, json={"stream_key": "k", "reason": "partner fixed"}, headers=BEARER
        )
        assert released.status_code == 200, released.text
        [done] = released.json()["released"]
        assert (done["stream_key"], done["dropped"], done["message_id"]) == (
            "k",
            False,
            second.message_id,
        )
        assert (await get(client, "/api/held"))["keys"] == []
        [entry] = (await get(client, "/api/audit"))["entries"]
    assert (entry["actor"], entry["action"], entry["target"]) == (
        "http:127.0.0.1",
        "release",
        "events",
    )
    assert entry["detail"]["reason"] == "partner fixed"
    assert [status for _, status, _ in await rows(database)] == ["published", "pending", "pending"]


async def test_an_operator_releases_a_held_key_from_the_page(
    database: Database, browser: Browser
) -> None:
    await stage(database, 1, 2, 3)
    config = config_of(database)
    async with opened(database) as store:
        await keep_the_second(database, store, "held")
    async with console(config) as (server, client):
        page, errors = await open_console(browser, f"http://127.0.0.1:{server.port}/#token={TOKEN}")
        events = page.locator('[data-testid="target"][data-target="main/events"]')
        await expect(events.get_by_test_id("state")).to_have_text("1 held key")
        await page.get_by_test_id("tab-held").click()
        row = page.get_by_test_id("held-row")
        await expect(row).to_have_count(1)
        await expect(row.get_by_test_id("held-key")).to_have_text("k")
        await row.get_by_test_id("release").click()  # no reason yet: refused, nothing done
        await expect(page.get_by_test_id("notice-text")).to_contain_text("needs a reason")
        await expect(page.get_by_test_id("confirm")).to_be_hidden()
        await page.get_by_test_id("release-reason").fill("partner fixed")
        await row.get_by_test_id("release").click()
        confirm = page.get_by_test_id("confirm")
        await expect(confirm.get_by_test_id("confirm-text")).to_have_text("Retry the head of k?")
        await confirm.get_by_test_id("confirm-yes").click()
        await expect(page.get_by_test_id("no-held")).to_be_visible()
        await expect(page.get_by_test_id("notice-text")).to_contain_text("Released k")
        await expect(events.get_by_test_id("state")).to_have_text("ok")
        [entry] = (await get(client, "/api/audit"))["entries"]
    assert (entry["action"], entry["detail"]["reason"]) == ("release", "partner fixed")
    assert errors == []
