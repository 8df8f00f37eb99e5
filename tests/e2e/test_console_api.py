"""The console's operator API on the real uvicorn server, on PostgreSQL, SQLite and MariaDB: a
router fails rows against a partner that is down (others were rejected earlier), then the
failure groups are listed, requeued and discarded over HTTP (audited as ``http:<client>``),
the message browser pages and filters the outbox, one message shows as each target receives
it, and no configured secret appears in an answer."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from router import Outbox, RouterConfig
from router.config import DatabaseSettings
from router.ops.migrate import upgrade
from router.ops.schema import outbox as outbox_table
from router.serve.console import StatusService
from router.serve.http_app import HttpServer, build_app
from tests.conftest import Database, MysqlDatabases, PgDatabases, make_config
from tests.integration.events import OrderPlaced, StockReserved
from tests.integration.test_delivery import serving
from tests.services import free_port

TOKEN = "console-api-t0ken-value"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
PASSWORD = "n4ts-partner-passw0rd"
REJECTED = "rejected by JetStream: maximum payload exceeded (code 400, err_code 10054)"
FAILED = ("failed", "abandoned")
# The partner is down for good: each row fails once, then waits an hour for its next try.
RETRY = {"max_attempts": 3, "base_delay": 3600, "max_delay": 3600}
ENTRY_KEYS = {
    "seq",
    "database",
    "message_id",
    "target",
    "event_type",
    "stream_key",
    "status",
    "attempts",
    "created_at",
    "published_at",
    "last_error",
}


@dataclass(frozen=True)
class Failed:
    """An outbox after a router ran with its partner down."""

    brokers: dict[str, Any]
    partner_url: str
    orders: list[str]
    """OrderPlaced ids, o-0 to o-3: the partner refused the first two, rejected the others."""
    stock: list[str]
    """StockReserved ids (internal only)."""

    @property
    def refused(self) -> list[str]:
        return self.orders[:2]

    @property
    def rejected(self) -> list[str]:
        return self.orders[2:]


def partner_brokers() -> tuple[dict[str, Any], str]:
    """An internal broker that takes everything, and a NATS partner where nothing listens
    (its URL carries a password)."""
    url = f"nats://ops:{PASSWORD}@127.0.0.1:{free_port()}"
    partner = {
        "type": "nats",
        "url": url,
        "destination": "shop.{event_type}",
        "stream": {"name": "SHOP", "subjects": ["shop.>"]},
    }
    return {"events": {"type": "memory", "internal": True}, "partner": partner}, url


async def rows_of(database: Database, *where: Any) -> dict[tuple[str, str], tuple[str, int]]:
    """(status, attempts) by (message id, target)."""
    o = outbox_table
    found = await database.execute(
        sa.select(o.c.message_id, o.c.target, o.c.status, o.c.attempts).where(*where)
    )
    return {(str(r["message_id"]), r["target"]): (r["status"], r["attempts"]) for r in found}


async def fail_some(database: Database) -> Failed:
    """Four OrderPlaced (to both targets, each on its own stream) and two StockReserved (to
    the internal broker alone). The partner rejected two orders a day ago (abandoned); a
    router then delivers everything to the internal broker and fails the other two orders
    against the partner, which is down."""
    brokers, url = partner_brokers()
    config = make_config(
        {"main": database.url}, brokers, base_dir=database.base_dir, outbox={"retry": RETRY}
    )
    outbox = Outbox(config)
    try:
        async with outbox.transaction() as tx:
            orders = await tx.stage(
                *(OrderPlaced(order_id=f"o-{i}", total=Decimal(i)) for i in range(4)),
                stream_keys=[f"order-{i}" for i in range(4)],
            )
            stock = await tx.stage(
                *(StockReserved(order_id=f"o-{i}", quantity=i + 1) for i in range(2))
            )
    finally:
        await outbox.close()
    failed = Failed(brokers, url, orders, stock)
    o = outbox_table
    await database.execute(
        sa.update(o)
        .where(o.c.target == "partner", o.c.message_id.in_(failed.rejected))
        .values(
            status="abandoned",
            attempts=1,
            last_error=f"not retryable: {REJECTED}",
            last_attempt_at=datetime.now(UTC) - timedelta(days=1),
        )
    )

    async def settled() -> bool:
        found = await rows_of(database)
        return all(
            status in ("pending", "abandoned") if target == "partner" else status == "published"
            for (_, target), (status, _) in found.items()
        )

    async with serving(config):
        deadline = time.monotonic() + 20
        while not await settled():
            assert time.monotonic() < deadline, await rows_of(database)
            await asyncio.sleep(0.05)
    # An unreachable partner costs rows no attempt (they wait behind its open circuit), so
    # the two refused orders are given what a broker's retryable refusal leaves: failed, one
    # attempt, the error, their retry an hour away. (Rows from a router before 0.2 that
    # failed on an unreachable broker look the same.)
    await database.execute(
        sa.update(o)
        .where(o.c.target == "partner", o.c.message_id.in_(failed.refused))
        .values(
            status="failed",
            attempts=1,
            last_error=f"partner: cannot connect to {url}: ConnectionRefusedError",
            first_attempt_at=datetime.now(UTC),
            last_attempt_at=datetime.now(UTC),
            available_at=datetime.now(UTC) + timedelta(hours=1),
        )
    )
    return failed


@contextlib.asynccontextmanager
async def console(
    config: RouterConfig, *, token: str | None = TOKEN
) -> AsyncIterator[tuple[HttpServer, httpx.AsyncClient]]:
    """The console of a router with ``config`` (and ``token``), served by the real uvicorn
    server on a port the system picks, and a client of it."""
    config = config.model_copy(
        update={"http": config.http.model_validate({"token": token} if token else {})}
    )
    service = StatusService(config, CollectorRegistry(), lambda: {"worker": "test"})
    server = HttpServer("127.0.0.1", 0, build_app(service))
    await server.start()
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{server.port}", timeout=10, trust_env=False
        ) as client:
            yield server, client
    finally:
        await server.stop()


def config_of(database: Database, failed: Failed) -> RouterConfig:
    return make_config({"main": database.url}, failed.brokers, base_dir=database.base_dir)


async def get(client: httpx.AsyncClient, path: str, **params: Any) -> Any:
    response = await client.get(path, params=params, headers=BEARER)
    assert response.status_code == 200, response.text
    return response.json()


async def browse(client: httpx.AsyncClient, **params: Any) -> list[dict[str, Any]]:
    """Every entry /api/messages lists with these filters (one page of up to 200)."""
    document = await get(client, "/api/messages", limit=200, **params)
    assert document["next_before"] is None
    entries: list[dict[str, Any]] = document["messages"]
    return entries


# --- failure groups -------------------------------------------------------------------------


async def test_groups_are_listed_requeued_and_discarded_over_http(database: Database) -> None:
    failed = await fail_some(database)
    partner = outbox_table.c.target == "partner"
    before = await rows_of(database, partner)
    async with console(config_of(database, failed)) as (_, client):
        groups = (await get(client, "/api/groups"))["groups"]
        assert [(g["target"], g["count"], g["statuses"]) for g in groups] == [
            ("partner", 2, {"failed": 2, "abandoned": 0}),  # tried just now: the newest first
            ("partner", 2, {"failed": 0, "abandoned": 2}),
        ]
        down, bounced = groups
        assert down["error_class"] == "ConnectionRefusedError"
        assert down["sample"]["message_id"] == failed.refused[0]
        assert (bounced["error_class"], bounced["code"]) == ("rejected", "err_code 10054")
        assert (await get(client, "/api/groups", database="main", target="partner")) == {
            "groups": groups
        }
        assert (await get(client, "/api/groups", target="events")) == {"groups": []}
        unknown_database = await client.get("/api/groups?database=other", headers=BEARER)
        assert (unknown_database.status_code, unknown_database.json()) == (
            404,
            {"error": "unknown database 'other'"},
        )

        requeue = f"/api/groups/main/{down['id']}/requeue"
        discard = f"/api/groups/main/{bounced['id']}/discard"
        dry = [
            await client.post(requeue, json={"dry_run": True}, headers=BEARER),
            await client.post(discard, json={"dry_run": True}, headers=BEARER),
        ]
        assert [(r.status_code, r.json()) for r in dry] == [
            (200, {"group": down["id"], "database": "main", "rows": 2, "dry_run": True}),
            (200, {"group": bounced["id"], "database": "main", "rows": 2, "dry_run": True}),
        ]
        refused = [
            await client.post("/api/groups/main/0123456789/requeue", headers=BEARER),
            await client.post("/api/groups/other/0123456789/discard", headers=BEARER),
            # A misspelt dry_run, or a body that is no object, must not act for real.
            await client.post(discard, json={"dryrun": True}, headers=BEARER),
            await client.post(discard, json={"dry_run": "yes"}, headers=BEARER),
            await client.post(discard, content=b"[true]", headers=BEARER),
        ]
        assert [(r.status_code, r.json()) for r in refused] == [
            (404, {"error": "no failure group '0123456789' in database 'main'"}),
            (404, {"error": "unknown database 'other'"}),
            (400, {"error": 'the body is {"dry_run": true} or {}'}),
            (400, {"error": 'the body is {"dry_run": true} or {}'}),
            (400, {"error": "the body must be a JSON object"}),
        ]
        assert await rows_of(database, partner) == before
        assert (await get(client, "/api/audit"))["entries"] == []

        requeued = await client.post(requeue, headers=BEARER)
        assert (requeued.status_code, requeued.json()) == (
            200,
            {"group": down["id"], "database": "main", "rows": 2, "dry_run": False},
        )
        pending = await browse(client, target="partner", status="pending")
        assert sorted(e["message_id"] for e in pending) == sorted(failed.refused)

        discarded = await client.post(discard, json={"dry_run": False}, headers=BEARER)
        assert (discarded.status_code, discarded.json()) == (
            200,
            {"group": bounced["id"], "database": "main", "rows": 2, "dry_run": False},
        )
        listed = await browse(client, target="partner")
        assert sorted(e["message_id"] for e in listed) == sorted(failed.refused)
        assert (await get(client, "/api/groups")) == {"groups": []}
        entries = (await get(client, "/api/audit"))["entries"]
        latest = (await get(client, "/api/audit", database="main", limit=1))["entries"]

    assert [(e["actor"], e["action"], e["target"], e["row_count"]) for e in entries] == [
        ("http:127.0.0.1", "discard", "partner", 2),
        ("http:127.0.0.1", "requeue", "partner", 2),
    ]
    assert [e["detail"]["group"] for e in entries] == [bounced["id"], down["id"]]
    assert sorted(entries[0]["detail"]["message_ids"]) == sorted(failed.rejected)
    assert latest == entries[:1]
    after = await rows_of(database, partner)
    assert after == {(i, "partner"): ("pending", 0) for i in failed.refused}


async def test_the_group_posts_follow_the_post_rules(database: Database) -> None:
    failed = await fail_some(database)
    before = await rows_of(database)
    config = config_of(database, failed)
    async with console(config, token=None) as (_, client):
        # Without a token every GET is open, and every POST is off.
        down, bounced = (await client.get("/api/groups")).json()["groups"]
        paths = [
            f"/api/groups/main/{down['id']}/requeue",
            f"/api/groups/main/{bounced['id']}/discard",
        ]
        off = [
            await client.post(path, headers=headers) for path in paths for headers in ({}, BEARER)
        ]
    async with console(config) as (_, client):
        guarded = [
            await client.post(path, headers=headers)
            for path in paths
            for headers in (
                {},
                {"Authorization": "Bearer wrong"},
                {**BEARER, "Origin": "http://evil.example"},
                {**BEARER, "Sec-Fetch-Site": "cross-site"},
            )
        ]
        unauthorised_gets = [
            await client.get(path)
            for path in (
                "/api/groups",
                "/api/messages",
                f"/api/messages/{failed.orders[0]}",
                "/api/audit",
            )
        ]
    assert [(r.status_code, r.json()) for r in off] == [
        (403, {"error": "mutating routes are off: set http.token"})
    ] * 4
    assert [(r.status_code, r.json()["error"]) for r in guarded] == [
        (401, "a bearer token is required"),
        (401, "a bearer token is required"),
        (403, "cross-site requests are refused (Origin http://evil.example is not this host)"),
        (403, "cross-site requests are refused (Sec-Fetch-Site: cross-site)"),
    ] * 2
    assert [(r.status_code, r.json()) for r in unauthorised_gets] == [
        (401, {"error": "a bearer token is required"})
    ] * 4
    assert await rows_of(database) == before


# --- the message browser --------------------------------------------------------------------


async def test_the_message_browser_pages_and_filters(database: Database) -> None:
    failed = await fail_some(database)
    o = outbox_table
    every = [r["seq"] for r in await database.execute(sa.select(o.c.seq).order_by(o.c.seq.desc()))]
    assert len(every) == 10  # 4 orders x 2 targets, 2 stock reservations
    async with console(config_of(database, failed)) as (_, client):
        pages: list[list[dict[str, Any]]] = []
        params: dict[str, Any] = {"limit": 2}
        while True:
            document = await get(client, "/api/messages", **params)
            pages.append(document["messages"])
            if document["next_before"] is None:
                break
            params["before"] = document["next_before"]
        by_type = await browse(client, type="stock_reserved")
        published = await browse(client, status="published")
        down = await browse(client, target="partner", status="failed")
        refused = await browse(client, error="CONNECTIONREFUSEDERROR")
        rejected = await browse(client, error="maximum payload")
        streamed = await browse(client, stream_key="order-1")
        one = failed.orders[1]
        by_prefix = await browse(client, q=one[:30])
        by_id = await browse(client, q=one.upper())
        by_short_prefix = await browse(client, q=one[:8])
        nothing = await browse(client, q="ffffffff-ffff")
        bad = [
            await client.get("/api/messages", params=params, headers=BEARER)
            for params in ({"q": "0189"}, {"q": "not an id at all"}, {"limit": "many"})
        ]
        unknown_database = await client.get("/api/messages?database=other", headers=BEARER)
        capped = await get(client, "/api/messages", limit=100000)

    assert [len(page) for page in pages] == [2, 2, 2, 2, 2]
    listed = [entry for page in pages for entry in page]
    assert [e["seq"] for e in listed] == every  # newest first, each row once
    assert {frozenset(e) for e in listed} == {frozenset(ENTRY_KEYS)}  # never the envelope
    assert {e["database"] for e in listed} == {"main"}
    assert {(e["message_id"], e["target"]) for e in listed} == set(await rows_of(database))

    assert sorted(e["message_id"] for e in by_type) == sorted(failed.stock)
    assert {(e["target"], e["event_type"]) for e in by_type} == {("events", "stock_reserved")}
    assert {(e["target"], e["status"]) for e in published} == {("events", "published")}
    assert len(published) == 6 and all(e["published_at"] for e in published)
    assert sorted(e["message_id"] for e in down) == sorted(failed.refused)
    assert [e["attempts"] for e in down] == [1, 1]
    assert sorted(e["message_id"] for e in refused) == sorted(failed.refused)
    assert all("ConnectionRefusedError" in e["last_error"] for e in refused)
    assert sorted(e["message_id"] for e in rejected) == sorted(failed.rejected)
    assert {e["status"] for e in rejected} == {"abandoned"}
    assert {(e["message_id"], e["target"]) for e in streamed} == {
        (one, "events"),
        (one, "partner"),
    }
    assert {(e["message_id"], e["target"]) for e in by_prefix} == {
        (one, "events"),
        (one, "partner"),
    }
    assert by_id == by_prefix
    assert {(one, "events"), (one, "partner")} <= {
        (e["message_id"], e["target"]) for e in by_short_prefix
    }
    assert all(e["message_id"].startswith(one[:8]) for e in by_short_prefix)
    assert nothing == []
    assert [(r.status_code, r.json()) for r in bad] == [
        (400, {"error": "q: a message id, or its first 8 characters or more"}),
        (400, {"error": "q: a message id, or its first 8 characters or more"}),
        (400, {"error": "limit: a number of rows, at most 200"}),
    ]
    assert (unknown_database.status_code, unknown_database.json()) == (
        404,
        {"error": "unknown database 'other'"},
    )
    assert len(capped["messages"]) == 10 and capped["next_before"] is None


async def test_a_long_error_is_cut_to_300_characters(database: Database) -> None:
    outbox = database.outbox({"events": {"type": "memory", "internal": True}})
    try:
        async with outbox.transaction() as tx:
            [message_id] = await tx.stage(StockReserved(order_id="o-1", quantity=1))
    finally:
        await outbox.close()
    o = outbox_table
    await database.execute(sa.update(o).values(status="failed", last_error="x" * 5000))
    config = make_config(
        {"main": database.url},
        {"events": {"type": "memory", "internal": True}},
        base_dir=database.base_dir,
    )
    async with console(config) as (_, client):
        [entry] = await browse(client)
        [target] = (await get(client, f"/api/messages/{message_id}"))["targets"]
    assert entry["last_error"] == "x" * 299 + "…"
    assert target["last_error"] == "x" * 5000  # the trace shows it whole


@pytest.mark.parametrize("database", ["postgresql", "sqlite"], indirect=True)
async def test_several_databases_are_merged_by_time_and_paged_each_by_its_own_seq(
    database: Database, pg_databases: PgDatabases, mysql_databases: MysqlDatabases
) -> None:
    other = await second_database(database, pg_databases, mysql_databases)
    brokers = {"events": {"type": "memory", "internal": True}}
    config = make_config(
        {"main": database.url, "other": other}, brokers, base_dir=database.base_dir
    )
    outbox = Outbox(config)
    staged: set[tuple[str, str]] = set()
    try:
        for i in range(7):
            name = "main" if i % 2 == 0 else "other"
            async with outbox.transaction(name) as tx:
                [message_id] = await tx.stage(StockReserved(order_id=f"o-{i}", quantity=i))
            staged.add((name, message_id))
            await asyncio.sleep(0.01)  # apart in created_at
    finally:
        await outbox.close()
    async with console(config) as (_, client):
        pages: list[dict[str, Any]] = []
        params: dict[str, Any] = {"limit": 2}
        while True:
            pages.append(await get(client, "/api/messages", **params))
            if pages[-1]["next_before"] is None:
                break
            params["before"] = pages[-1]["next_before"]
        only_other = await get(client, "/api/messages", database="other", limit=2)
        one_seq = await client.get("/api/messages?before=3", headers=BEARER)
        foreign = await client.get("/api/messages?before=elsewhere:3", headers=BEARER)

    listed = [entry for page in pages for entry in page["messages"]]
    assert [len(page["messages"]) for page in pages] == [2, 2, 2, 1]
    assert sorted((e["database"], e["message_id"]) for e in listed) == sorted(staged)
    times = [e["created_at"] for e in listed]
    assert times == sorted(times, reverse=True)  # the newest first, whichever database
    # One cursor per database that has rows left.
    cursors = [page["next_before"] for page in pages[:-1]]
    assert all(re.fullmatch(r"(main|other):\d+(,(main|other):\d+)?", c) for c in cursors)
    assert {e["database"] for e in only_other["messages"]} == {"other"}
    assert isinstance(only_other["next_before"], int)  # one database: a seq
    assert one_seq.status_code == 400
    assert "several databases are browsed" in one_seq.json()["error"]
    assert foreign.status_code == 400


async def second_database(
    database: Database, pg_databases: PgDatabases, mysql_databases: MysqlDatabases
) -> str:
    """Another fresh, migrated database of the same kind; its URL."""
    if database.kind == "postgresql":
        return await pg_databases.new()
    if database.kind == "mysql":
        return await mysql_databases.new()
    url = "sqlite:///other.db"
    await upgrade("other", DatabaseSettings.model_validate({"url": url}), database.base_dir)
    return url


# --- one message ----------------------------------------------------------------------------


async def test_a_message_shows_as_each_target_receives_it(database: Database) -> None:
    failed = await fail_some(database)
    order, stock = failed.orders[0], failed.stock[0]
    async with console(config_of(database, failed)) as (_, client):
        shown = await get(client, f"/api/messages/{order}")
        internal_only = await get(client, f"/api/messages/{stock}")
        missing = [
            await client.get(f"/api/messages/{message_id}", headers=BEARER)
            for message_id in ("01890a5d-ac96-774b-bcce-b302099a8057", "not-a-message-id")
        ]

    assert shown["message_id"] == order
    targets = {t["target"]: t for t in shown["targets"]}
    assert sorted(targets) == ["events", "partner"]
    events, partner = targets["events"], targets["partner"]
    assert (events["status"], events["attempts"]) == ("published", 1)
    assert events["published_at"] is not None
    assert (partner["status"], partner["attempts"]) == ("failed", 1)
    assert "ConnectionRefusedError" in partner["last_error"]
    assert partner["first_attempt_at"] is not None and partner["receipt"] is None

    internal, external = events["message"], partner["message"]
    assert external["destination"] == "shop.order_placed"
    assert internal["destination"] == events["destination"]
    # The internal broker gets the whole envelope, the partner the external one.
    assert internal["body"]["event_class"].endswith("OrderPlaced")
    assert "event_class" not in external["body"]
    for body in (internal["body"], external["body"]):
        assert body["id"] == order
        assert body["payload"]["order_id"] == "o-0"
    assert internal["body"]["sequence"] == events["seq"]
    assert internal["content_type"] == external["content_type"] == "application/json"
    assert isinstance(internal["headers"], dict) and isinstance(external["headers"], dict)

    assert [t["target"] for t in internal_only["targets"]] == ["events"]
    assert internal_only["targets"][0]["message"]["body"]["type"] == "stock_reserved"
    assert [(r.status_code, r.json()) for r in missing] == [
        (404, {"error": "no message '01890a5d-ac96-774b-bcce-b302099a8057'"}),
        (404, {"error": "no message 'not-a-message-id'"}),
    ]


@pytest.mark.parametrize("database", ["postgresql"], indirect=True)
async def test_a_message_shows_the_wire_details_preview_shows(database: Database) -> None:
    # Staged only: what each target receives is rendered from the stored row, as preview
    # renders it, whether or not a router ever published it.
    brokers = {
        "events": {"type": "memory", "internal": True},
        "feed": {
            "type": "nats",
            "destination": "feed.{event_type}",
            "stream": {"name": "FEED", "subjects": ["feed.>"]},
        },
        "analytics": {"type": "kafka", "destination": "shop.{event_type}"},
        "warehouse": {
            "type": "rabbitmq",
            "exchange": {"name": "shop.events", "type": "topic"},
            "destination": "{event_type}",
            "expose": {"fields": ["priority"]},
        },
    }
    config = make_config({"main": database.url}, brokers, base_dir=database.base_dir)
    outbox = Outbox(config)
    try:
        async with outbox.transaction() as tx:
            [order] = await tx.stage(
                OrderPlaced(order_id="o-1", total=Decimal(5)),
                stream_key="order-1",
                correlation_id="c-1",
                priority=5,
            )
    finally:
        await outbox.close()
    async with console(config) as (_, client):
        shown = await get(client, f"/api/messages/{order}")

    sent = {t["target"]: t["message"] for t in shown["targets"]}
    feed, analytics, warehouse = sent["feed"], sent["analytics"], sent["warehouse"]
    assert feed["headers"]["Nats-Msg-Id"] == order
    assert feed["binding"] == {"stream": "FEED"}
    assert analytics["headers"]["correlation_id"] == "c-1"
    assert analytics["properties"]["key"] == "order-1"
    assert warehouse["binding"]["exchange"]["name"] == "shop.events"
    assert {k: warehouse["properties"][k] for k in ("message_id", "priority", "delivery_mode")} == {
        "message_id": order,
        "priority": 5,
        "delivery_mode": 2,
    }


# --- secrets ----------------------------------------------------------------------------------


async def test_no_configured_secret_appears_in_an_answer(database: Database) -> None:
    failed = await fail_some(database)
    # A driver that quotes the address it could not reach, password and all.
    quoted = f"partner: cannot connect to {failed.partner_url}: ConnectionRefusedError"
    o = outbox_table
    await database.execute(
        sa.update(o)
        .where(o.c.target == "partner", o.c.message_id == failed.refused[0])
        .values(last_error=quoted)
    )
    async with console(config_of(database, failed)) as (_, client):
        answers = [
            await client.get(path, headers=BEARER)
            for path in (
                "/api/groups",
                "/api/messages?target=partner",
                f"/api/messages/{failed.refused[0]}",
            )
        ]
        groups = answers[0].json()["groups"]
        quoting = next(g for g in groups if g["sample"]["message_id"] == failed.refused[0])
        discard = f"/api/groups/main/{quoting['id']}/discard"
        answers.append(await client.post(discard, headers=BEARER))
        answers.append(await client.get("/api/audit", headers=BEARER))
    assert [r.status_code for r in answers] == [200] * 5
    assert [r.text for r in answers if PASSWORD in r.text or TOKEN in r.text] == []
    shown = quoted.replace(PASSWORD, "***")
    assert quoting["sample"]["last_error"] == shown
    [listed] = [e for e in answers[1].json()["messages"] if e["message_id"] == failed.refused[0]]
    assert listed["last_error"] == shown
    traced = {t["target"]: t for t in answers[2].json()["targets"]}
    assert traced["partner"]["last_error"] == shown
    assert answers[4].json()["entries"][0]["action"] == "discard"
