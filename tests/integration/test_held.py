"""Held and parked stream keys in each store, and the operator's release, on PostgreSQL, SQLite
and MariaDB: what a mark keeps, what a claim then takes (and parks), what ``router held``
lists, and what ``release`` (retry, drop, by failure group) puts back, with its audit row."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import sqlalchemy as sa

from envelopes import ConfigError
from router.config import RouterConfig
from router.ops.audit import history
from router.ops.groups import find_group, list_groups, requeue_group
from router.ops.held import held_keys, release, release_group
from router.ops.schema import outbox
from router.relay.store import Claim, ClaimedRow, Marks, OutboxStore, open_store
from tests.conftest import Database, make_config
from tests.integration.events import OrderPlaced

BROKERS = {"events": {"type": "memory", "internal": True}}
ERROR = "not retryable: rejected by JetStream: maximum payload exceeded (err_code 10054)"


def config_of(database: Database) -> RouterConfig:
    return make_config({"main": database.url}, BROKERS, base_dir=database.base_dir)


async def stage(database: Database, *numbers: int, key: str = "k") -> None:
    """Events ``numbers`` on stream ``key``, in one transaction."""
    outbox = database.outbox(BROKERS)
    try:
        async with outbox.transaction() as tx:
            events = [OrderPlaced(order_id=str(n), total=Decimal(n)) for n in numbers]
            await tx.stage(*events, stream_key=key)
    finally:
        await outbox.close()


@contextlib.asynccontextmanager
async def opened(database: Database) -> AsyncIterator[OutboxStore]:
    config = config_of(database)
    store = open_store("main", config.databases["main"], database.base_dir)
    try:
        yield store
    finally:
        await store.close()


async def claim(store: OutboxStore) -> Claim:
    return await store.claim("events", 10, "w1", 30)


async def rows(database: Database) -> list[tuple[str, str, int]]:
    """(order id, status, attempts) of every row, in outbox order."""
    return [
        (r["envelope"]["payload"]["order_id"], r["status"], r["attempts"])
        for r in await database.rows()
    ]


async def keep_the_second(
    database: Database, store: OutboxStore, status: str
) -> dict[str, ClaimedRow]:
    """Claim 1, 2 and 3 of stream k; publish 1, keep 2 (held or parked), 3 untried."""
    claimed = await claim(store)
    by_order = {_order(row): row for row in claimed.rows}
    assert sorted(by_order) == ["1", "2", "3"]
    second = by_order["2"]
    marks = Marks(
        published=[by_order["1"].seq],
        untried=[by_order["3"].seq],
        held=[(second.seq, ERROR)] if status == "held" else [],
        parked=[(second.seq, "k", ERROR)] if status == "parked" else [],
    )
    await store.mark("events", claimed.token, marks)
    return by_order


def _order(row: ClaimedRow) -> str:
    order: str = json.loads(row.envelope)["payload"]["order_id"]
    return order


async def test_a_held_head_holds_its_stream_until_released_and_is_tried_afresh(
    database: Database,
) -> None:
    await stage(database, 1, 2, 3)
    async with opened(database) as store:
        await keep_the_second(database, store, "held")
        assert await rows(database) == [
            ("1", "published", 1),
            ("2", "held", 1),
            ("3", "pending", 0),
        ]
        await stage(database, 4, key="other")
        await stage(database, 5)
        taken = await claim(store)  # the other stream flows; k waits, its rows untried
        assert [_order(row) for row in taken.rows] == ["4"]
        await store.mark("events", taken.token, Marks(published=[taken.rows[0].seq]))

        config = config_of(database)
        [key] = await held_keys(config)
        assert (key.target, key.stream_key, key.status, key.behind) == ("events", "k", "held", 2)
        assert key.last_error == ERROR and key.age_seconds is not None
        [released] = await release(config, "events", "k", reason="partner fixed", actor="ops@h")
        assert (released.stream_key, released.dropped, released.rows) == ("k", False, 1)
        assert await held_keys(config) == []
        assert [r[1:] for r in await rows(database)][1:3] == [("pending", 0), ("pending", 0)]

        again = await claim(store)  # the head first, its stream in order behind it
        assert [_order(row) for row in again.rows] == ["2", "3", "5"]
        assert [row.attempts for row in again.rows] == [1, 1, 1]
        await store.release("events", again.token, [row.seq for row in again.rows])

    [action] = await history(config)
    assert (action.actor, action.action, action.target, action.row_count) == (
        "ops@h",
        "release",
        "events",
        1,
    )
    assert action.detail["reason"] == "partner fixed"
    assert action.detail["stream_key"] == "k"
    assert action.detail["message_id"] == released.message_id
    assert action.detail["drop"] is False


async def test_a_released_head_stamped_ahead_of_the_relays_clock_still_goes_first(
    database: Database,
) -> None:
    """A release stamps its head with the operator's clock (the server's on MariaDB, at its
    statement's start). A claim whose clock reads earlier, because the operator's host runs
    ahead or because the claim's transaction began before the release committed (a run of
    batches on PostgreSQL), used to find the head not yet due while nothing held its stream
    back any more, and sent the rows behind it first. A pending row is due whatever its
    time: the head goes first, its stream behind it."""
    await stage(database, 1, 2, 3)
    async with opened(database) as store:
        kept = await keep_the_second(database, store, "held")
        config = config_of(database)
        await release(config, "events", "k", reason="partner fixed", actor="ops@h")
        ahead = datetime.now(UTC) + timedelta(hours=1)
        head = outbox.c.seq == kept["2"].seq
        await database.execute(sa.update(outbox).where(head).values(available_at=ahead))
        again = await claim(store)
        assert [_order(row) for row in again.rows] == ["2", "3"]
        await store.release("events", again.token, [row.seq for row in again.rows])


async def test_a_parked_stream_takes_its_later_rows_with_it_and_comes_back_in_order(
    database: Database,
) -> None:
    await stage(database, 1, 2, 3)
    async with opened(database) as store:
        await keep_the_second(database, store, "parked")
        assert await rows(database) == [
            ("1", "published", 1),
            ("2", "parked", 1),
            ("3", "parked", 0),
        ]
        await stage(database, 4, key="other")
        await stage(database, 5)  # on the parked stream: parked as it comes
        taken = await claim(store)
        assert [_order(row) for row in taken.rows] == ["4"]
        await store.mark("events", taken.token, Marks(published=[taken.rows[0].seq]))
        assert [status for _, status, _ in await rows(database)] == [
            "published",
            "parked",
            "parked",
            "published",
            "parked",
        ]

        config = config_of(database)
        [key] = await held_keys(config, "events")
        assert (key.status, key.behind) == ("parked", 2)
        [released] = await release(config, "events", "k", reason="retry", actor="ops@h")
        assert released.rows == 3  # the head, and the two rows parked behind it
        again = await claim(store)
        assert [_order(row) for row in again.rows] == ["2", "3", "5"]
        await store.release("events", again.token, [row.seq for row in again.rows])


async def test_dropping_a_held_head_leaves_a_gap_the_next_message_names(
    database: Database,
) -> None:
    await stage(database, 1, 2, 3)
    async with opened(database) as store:
        kept = await keep_the_second(database, store, "parked")
        config = config_of(database)
        [released] = await release(config, "events", "k", drop=True, reason="poison", actor="ops@h")
        assert (released.dropped, released.rows) == (True, 1)
        assert [status for _, status, _ in await rows(database)] == [
            "published",
            "abandoned",
            "pending",
        ]
        again = await claim(store)
        [third] = again.rows
        assert (_order(third), third.skipped) == ("3", (kept["2"].message_id,))
        await store.release("events", again.token, [third.seq])
    [action] = await history(config)
    assert action.detail["drop"] is True and action.detail["reason"] == "poison"


async def test_a_failure_group_releases_the_keys_whose_head_failed_its_way(
    database: Database,
) -> None:
    await stage(database, 1, 2, 3)
    await stage(database, 11, 12, key="other")
    async with opened(database) as store:
        claimed = await claim(store)
        heads = {_order(row): row for row in claimed.rows}
        marks = Marks(
            published=[heads["1"].seq, heads["11"].seq],
            held=[(heads["2"].seq, ERROR), (heads["12"].seq, "not retryable: something else")],
            untried=[heads["3"].seq],
        )
        await store.mark("events", claimed.token, marks)

    config = config_of(database)
    group = next(g for g in await list_groups(config) if g.sample.last_error == ERROR)
    assert (group.count, group.statuses) == (1, {"failed": 0, "abandoned": 0, "held": 1})
    assert group.id == next(k.group for k in await held_keys(config) if k.stream_key == "k")
    assert await requeue_group(config, group, actor="ops@h") == 0  # held: for release alone
    found = await find_group(config, group.id)
    assert found is not None
    [released] = await release_group(config, found, reason="limit raised", actor="ops@h")
    assert released.stream_key == "k"
    assert [k.stream_key for k in await held_keys(config)] == ["other"]
    actions = await history(config)
    assert actions[0].detail["group"] == group.id
    assert actions[0].detail["keys"] == ["k"]


async def test_releasing_a_key_nothing_holds_does_nothing_and_a_reason_is_required(
    database: Database,
) -> None:
    config = config_of(database)
    assert await release(config, "events", "nobody", reason="just in case", actor="ops@h") == []
    assert await history(config) == []
    with pytest.raises(ConfigError, match="reason"):
        await release(config, "events", "k", reason=" ", actor="ops@h")
    with pytest.raises(ConfigError, match="unknown target"):
        await release(config, "partner", "k", reason="typo", actor="ops@h")
