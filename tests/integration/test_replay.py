"""Replay and backfill on every database kind, against real NATS (internal) and Redis
(partners): a replay sends one target's retained events again with their original message
ids and touches no other target; a backfill brings a new partner up to date with the events
it would have been sent; an interrupted replay resumes without sending anything twice."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import Counter
from decimal import Decimal
from typing import Any

import orjson
import pytest

from envelopes import ConfigError
from router import Outbox
from router.config import RouterConfig
from router.ops.replay import ReplayPlan, replay, resume_plan
from tests.conftest import Database, make_config
from tests.contract.harnesses import NatsHarness, RedisHarness
from tests.integration.events import OrderPlaced, StockReserved
from tests.integration.test_delivery import serving, wait_until
from tests.services import REDIS, require

EVENTS = 12


def config_for(database: Database, nats: NatsHarness, redis: RedisHarness, *partners: str) -> Any:
    brokers: dict[str, Any] = {"events": nats.config(internal=True)}
    for name in partners:
        brokers[name] = redis.config(destination=f"c{redis.tag}.{name}.{{event_type}}")
    return make_config(
        {"main": database.url}, brokers, database.base_dir, events=["tests.integration.events"]
    )


async def ids_at(redis: RedisHarness, partner: str, count: int) -> Counter[str]:
    arrived = await redis.arrived(f"c{redis.tag}.{partner}.order_placed", count)
    return Counter(a.headers["message-id"] for a in arrived)


async def all_published(database: Database) -> bool:
    rows = await database.execute("SELECT status FROM router_outbox")
    return all(r["status"] == "published" for r in rows)


async def deliver(config: RouterConfig, database: Database, until: Any) -> None:
    async with serving(config):
        await wait_until(until, timeout=30)
        await wait_until(lambda: all_published(database), timeout=30)


@pytest.fixture
async def harnesses() -> Any:
    require("Redis", REDIS)
    nats, redis = NatsHarness(), RedisHarness()
    yield nats, redis
    await nats.cleanup()
    await redis.cleanup()


async def test_replay_and_backfill(
    database: Database, harnesses: tuple[NatsHarness, RedisHarness]
) -> None:
    nats, redis = harnesses
    before = make_config(
        {"main": database.url},
        {
            "events": nats.config(internal=True),
            "partner": redis.config(destination=f"c{redis.tag}.partner.{{event_type}}"),
        },
        database.base_dir,
    )
    outbox = Outbox(before)
    async with outbox.transaction() as tx:
        staged = await tx.stage(
            *(OrderPlaced(order_id=f"o-{i}", total=Decimal(i)) for i in range(EVENTS)),
            stream_keys=[f"customer-{i % 3}" for i in range(EVENTS)],
        )
        await tx.stage(
            StockReserved(order_id="o-0", quantity=1)
        )  # internal only: never a partner's
    await outbox.close()

    async def first_round() -> bool:
        return sum((await ids_at(redis, "partner", EVENTS)).values()) == EVENTS

    await deliver(before, database, first_round)
    internal_before = await nats.arrived(nats.destination("order_placed"), EVENTS)

    # A dry run counts and changes nothing.
    plan = ReplayPlan(database="main", target="partner")
    counted = await replay(before, plan, actor="test", dry_run=True)
    assert (counted.total, counted.done, counted.audit_id) == (EVENTS, 0, None)
    assert await all_published(database)

    # The replay: every retained partner row once more, original ids, in stream order.
    done = await replay(before, ReplayPlan(database="main", target="partner"), actor="test")
    assert (done.total, done.done) == (EVENTS, EVENTS)

    async def second_round() -> bool:
        return sum((await ids_at(redis, "partner", 2 * EVENTS)).values()) == 2 * EVENTS

    await deliver(before, database, second_round)
    assert await ids_at(redis, "partner", 2 * EVENTS) == Counter(dict.fromkeys(staged, 2))
    internal_after = await nats.arrived(nats.destination("order_placed"), EVENTS)
    assert len(internal_before) == len(internal_after) == EVENTS  # no other target touched

    # Backfill: a new partner gets every published event it would have been sent, and
    # nothing internal-only.
    after = config_for(database, nats, redis, "partner", "newcomer")
    with pytest.raises(ConfigError, match="events:"):  # routing needs the event classes
        await replay(
            before, ReplayPlan(database="main", target="partner", backfill=True), actor="test"
        )
    backfill = ReplayPlan(database="main", target="newcomer", backfill=True, rate=200)
    filled = await replay(after, backfill, actor="test")
    assert (filled.total, filled.done) == (EVENTS, EVENTS)
    assert filled.elapsed >= (EVENTS - 1) / 200  # paced
    again = await replay(after, backfill, actor="test")  # nothing left: idempotent
    assert (again.total, again.done) == (0, 0)

    async def newcomer_filled() -> bool:
        return sum((await ids_at(redis, "newcomer", EVENTS)).values()) == EVENTS

    await deliver(after, database, newcomer_filled)
    assert await ids_at(redis, "newcomer", EVENTS) == Counter(dict.fromkeys(staged, 1))

    # An interrupted replay resumes where it stopped: each row is sent once more, not twice.
    slow = ReplayPlan(database="main", target="partner", rate=20)
    task = asyncio.create_task(replay(after, slow, actor="test"))
    await asyncio.sleep(0.3)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    [started] = await database.execute(
        "SELECT id, detail FROM router_audit WHERE action = 'replay' ORDER BY id DESC LIMIT 1"
    )
    assert orjson.loads(started["detail"])["rate"] == 20
    resumed_plan = await resume_plan(after, "main", started["id"])
    assert resumed_plan.started_at == slow.started_at
    resumed = await replay(
        after,
        dataclasses.replace(resumed_plan, rate=None),
        actor="test",
        resumed_from=started["id"],
    )
    assert 0 < resumed.done < EVENTS  # the rest, not all of them

    async def third_round() -> bool:
        return sum((await ids_at(redis, "partner", 3 * EVENTS)).values()) == 3 * EVENTS

    await deliver(after, database, third_round)
    assert await ids_at(redis, "partner", 3 * EVENTS) == Counter(dict.fromkeys(staged, 3))

    audit = await database.execute("SELECT action, row_count FROM router_audit ORDER BY id")
    assert [(r["action"], r["row_count"]) for r in audit][:4] == [
        ("replay", EVENTS),
        ("replay-finished", EVENTS),
        ("backfill", EVENTS),
        ("backfill-finished", EVENTS),
    ]
