"""Atomic units through the Redis adapter (``RedisBroker.publish_atomic``): each unit one
script (``brokers.redis._script``), or one MULTI/EXEC transaction for a user without
scripting, read back with XRANGE as a consumer would.

Most tests run against the shared Redis through the contract suite's harness. Those that need
a refusal Redis makes when a command is queued (a key the user may not write, no memory left)
run against a private ``redis-server`` with ACL users of its own, started here on a free port:
the shared server is never reconfigured.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis

from brokers import AtomicBroker, OutgoingMessage, PublishResult, create_broker
from brokers.redis import RedisSettings, _units
from brokers.redis._script import MARKER_PREFIX, SCRIPT_GRANTS, SHA
from envelopes import BrokerUnavailable
from tests.contract.harnesses import REDIS_URL, Arrived, RedisHarness
from tests.contract.test_contract import message
from tests.peers.redis import private_redis as start_private_redis

# The private server's users may write atomic.ok.* and the units' markers only: "partner"
# by script or in a transaction; "no-scripts" in a transaction only; "no-multi" XADD alone.
PARTNER_KEYS = "atomic.ok."
SCRIPTING = ("+evalsha", "+eval", "+get", "+set", "+type")
USERS = (
    ("partner", "+xadd", "+multi", "+exec", *SCRIPTING),
    ("no-scripts", "+xadd", "+multi", "+exec"),
    ("no-multi", "+xadd"),
)


@pytest.fixture(scope="module")
def private_redis() -> Iterator[int]:
    """A redis-server of this module's own, with the ACL users of ``USERS``; its port."""
    with start_private_redis(USERS, [f"{PARTNER_KEYS}*", f"{MARKER_PREFIX}*"]) as port:
        yield port


def private_settings(port: int, user: str) -> RedisSettings:
    return RedisSettings.model_validate(
        {"type": "redis", "url": f"redis://{user}@127.0.0.1:{port}/0", "destination": "x"}
    )


def unit(
    settings: Any, destinations: list[str], first: int, *, stream: str
) -> list[OutgoingMessage]:
    """One message per destination, numbered from ``first``, all of one stream key."""
    return [
        message(settings, destination, first + i, stream=stream)
        for i, destination in enumerate(destinations)
    ]


def numbers(arrived: list[Arrived]) -> list[int]:
    return [orjson.loads(a.body)["payload"]["n"] for a in arrived]


async def publish_atomic(
    settings: Any, units: list[list[OutgoingMessage]], *, max_unit: int | None = None
) -> list[list[PublishResult]]:
    broker = create_broker("partner", settings)
    assert isinstance(broker, AtomicBroker)
    if max_unit is not None:
        broker.max_unit = max_unit
    try:
        return await broker.publish_atomic(units)
    finally:
        await broker.close()


async def xrange(url: str, stream: str) -> list[int]:
    """The ``n`` of every entry of ``stream``, in stream order."""
    client = aioredis.Redis.from_url(url)
    try:
        entries: Any = await client.xrange(stream)
    finally:
        await client.aclose()
    return [orjson.loads(fields[b"body"])["payload"]["n"] for _, fields in entries]


async def test_units_are_stored_whole_in_order_with_a_receipt_per_member(
    redis_harness: RedisHarness,
) -> None:
    settings = redis_harness.settings()
    orders = redis_harness.destination("orders")
    first = unit(settings, [orders] * 3, 1, stream="a")
    second = unit(settings, [orders], 4, stream="b")
    results = await publish_atomic(settings, [first, second])
    assert [[r.ok for r in u] for u in results] == [[True, True, True], [True]]
    arrived = await redis_harness.arrived(orders, 4)
    assert numbers(arrived) == [1, 2, 3, 4]
    assert [a.native_id for a in arrived] == [m.wire.message_id for m in first + second]
    receipts = [orjson.loads(r.receipt or "{}") for u in results for r in u]
    assert receipts == [a.position for a in arrived]


async def test_units_larger_than_a_pipeline_go_whole_and_in_order(
    redis_harness: RedisHarness,
) -> None:
    # max_in_flight 2: the units [1], [2 3 4], [5], [6 7] take three pipelines, the second
    # holding a unit of three on its own.
    settings = redis_harness.settings(max_in_flight=2)
    orders, audit = redis_harness.destination("orders"), redis_harness.destination("audit")
    units = [
        unit(settings, [orders], 1, stream="a"),
        unit(settings, [orders, audit, orders], 2, stream="b"),
        unit(settings, [audit], 5, stream="c"),
        unit(settings, [orders, orders], 6, stream="d"),
    ]
    results = await publish_atomic(settings, units)
    assert [len(u) for u in results] == [1, 3, 1, 2]
    assert all(r.ok for u in results for r in u)
    assert await xrange(REDIS_URL, orders) == [1, 2, 4, 6, 7]
    assert await xrange(REDIS_URL, audit) == [3, 5]
    streams = [orjson.loads(r.receipt or "{}")["stream"] for u in results for r in u]
    assert streams == [orders, orders, audit, orders, audit, orders, orders]


async def test_units_trim_their_streams_to_maxlen_as_plain_writes_do(
    redis_harness: RedisHarness,
) -> None:
    # MAXLEN ~ trims whole nodes of the stream (100 entries each by default): 300 entries with
    # maxlen 10 keep the newest, at least 10 and far fewer than 300.
    settings = redis_harness.settings(maxlen=10)
    orders = redis_harness.destination("orders")
    units = [unit(settings, [orders], n, stream=f"k{n}") for n in range(1, 301)]
    results = await publish_atomic(settings, units)
    assert all(r.ok for u in results for r in u)
    kept = await xrange(REDIS_URL, orders)
    assert 10 <= len(kept) <= 200
    assert kept == list(range(301 - len(kept), 301))  # the newest, in order


async def test_a_unit_whose_key_has_the_wrong_type_stores_none_and_names_member_one(
    redis_harness: RedisHarness,
) -> None:
    settings = redis_harness.settings()
    wrong, orders = redis_harness.rejected_destination(), redis_harness.destination("orders")
    await redis_harness.prepare(wrong)  # a string: every XADD to it fails when EXEC runs it
    refused, apart = await publish_atomic(
        settings,
        [unit(settings, [wrong] * 3, 1, stream="a"), unit(settings, [orders], 4, stream="b")],
    )
    assert len(set(refused)) == 1, "one verdict for the whole unit"
    error = refused[0].error or ""
    assert not refused[0].ok and not refused[0].retryable and not refused[0].unreachable
    assert error.startswith("atomic unit of 3 refused: member 1 (")
    assert "WRONGTYPE" in error
    assert "yet Redis stored" not in error
    assert apart[0].ok
    assert await xrange(REDIS_URL, orders) == [4]


async def test_a_key_of_the_wrong_type_anywhere_in_a_unit_stores_none_of_it(
    redis_harness: RedisHarness,
) -> None:
    # The script looks at every member's key before its first XADD: members 1 and 3 go to a
    # stream, member 2 to a string key, and nothing of the unit is stored.
    settings = redis_harness.settings()
    wrong, orders = redis_harness.rejected_destination(), redis_harness.destination("orders")
    await redis_harness.prepare(wrong)
    refused_unit = unit(settings, [orders, wrong, orders], 1, stream="a")
    refused, apart = await publish_atomic(
        settings, [refused_unit, unit(settings, [orders], 4, stream="b")]
    )
    assert len(set(refused)) == 1
    assert not refused[0].ok and not refused[0].retryable
    assert refused[0].error == (
        f"atomic unit of 3 refused: member 2 ({refused_unit[1].wire.message_id}): rejected by "
        f"Redis: WRONGTYPE {wrong} holds a string, not a stream"
    )
    assert apart[0].ok
    assert await xrange(REDIS_URL, orders) == [4]


async def test_an_xadd_failing_half_way_fails_its_unit_yet_redis_keeps_the_members_before(
    redis_harness: RedisHarness,
) -> None:
    # What Redis does, and the adapter says: a script does not roll back. Member 2 goes to a
    # stream whose ids are exhausted (its last entry's id is the largest there is): member 1
    # is stored, member 2 fails, member 3 is never tried.
    settings = redis_harness.settings()
    full, orders = redis_harness.destination("full"), redis_harness.destination("orders")
    admin = aioredis.Redis.from_url(REDIS_URL)
    try:
        await admin.xadd(full, {"n": "0"}, id=f"{2**64 - 1}-{2**64 - 1}")
    finally:
        await admin.aclose()
    half = unit(settings, [orders, full, orders], 1, stream="a")
    refused, apart = await publish_atomic(settings, [half, unit(settings, [orders], 4, stream="b")])
    assert len(set(refused)) == 1
    assert not refused[0].ok and not refused[0].retryable
    error = refused[0].error or ""
    assert error.startswith(f"atomic unit of 3 refused: member 2 ({half[1].wire.message_id}): ")
    assert "exhausted" in error
    arrived = await redis_harness.arrived(orders, 2)
    assert numbers(arrived) == [1, 4]  # what a consumer of the stream sees
    stored = arrived[0].position["id"] if arrived[0].position else None
    assert error.endswith(
        f"; yet Redis stored member 1 ({orders} {stored}) (a script does not roll back)"
    )
    assert apart[0].ok


async def test_a_unit_sent_again_is_stored_once_and_answered_with_the_same_entry_ids(
    redis_harness: RedisHarness,
) -> None:
    """A relay that lost the answer sends the unit again (the same members, to the same
    streams): the unit's marker says it is stored, and each member is acknowledged with the
    entry id of its first storing, marked a duplicate."""
    settings = redis_harness.settings()
    orders, audit = redis_harness.destination("orders"), redis_harness.destination("audit")
    sent = unit(settings, [orders, audit, orders], 1, stream="a")
    (first,) = await publish_atomic(settings, [sent])
    (again,) = await publish_atomic(settings, [sent])
    assert all(r.ok for r in first + again)
    receipts = [orjson.loads(r.receipt or "{}") for r in first]
    assert [orjson.loads(r.receipt or "{}") for r in again] == [
        {**r, "duplicate": True} for r in receipts
    ]
    assert await xrange(REDIS_URL, orders) == [1, 3]
    assert await xrange(REDIS_URL, audit) == [2]
    # Another unit of the same messages (one member fewer) is another unit: stored.
    (other,) = await publish_atomic(settings, [sent[:2]])
    assert [orjson.loads(r.receipt or "{}").get("duplicate") for r in other] == [None, None]
    assert await xrange(REDIS_URL, orders) == [1, 3, 1]


async def test_a_server_without_the_script_cached_gets_it_by_eval(
    private_redis: int, caplog: pytest.LogCaptureFixture
) -> None:
    """EVALSHA answered NOSCRIPT (a restarted server, SCRIPT FLUSH): the unit goes again with
    the script's text, once, and no warning."""
    settings = private_settings(private_redis, "partner")
    stream = f"{PARTNER_KEYS}flushed"
    admin = aioredis.Redis.from_url(f"redis://127.0.0.1:{private_redis}/0")
    try:
        await admin.script_flush()  # this module's own server
        (stored,) = await publish_atomic(settings, [unit(settings, [stream] * 2, 1, stream="a")])
        assert await admin.script_exists(SHA) == [True]
    finally:
        await admin.aclose()
    assert all(r.ok for r in stored)
    assert await xrange(f"redis://127.0.0.1:{private_redis}/0", stream) == [1, 2]
    assert "redis.unit_script.unavailable" not in caplog.text


async def test_a_user_without_scripting_writes_units_by_multi_exec_and_says_once(
    private_redis: int, caplog: pytest.LogCaptureFixture
) -> None:
    """The script refused (NOPERM to EVALSHA): the unit goes by MULTI/EXEC, stored and
    acknowledged, and one warning says what to grant and what is lost without it."""
    settings = private_settings(private_redis, "no-scripts")
    stream = f"{PARTNER_KEYS}no-scripts"
    sent = unit(settings, [stream] * 2, 1, stream="a")
    caplog.set_level(logging.WARNING, logger="brokers.redis._adapter")
    broker = create_broker("partner", settings)
    assert isinstance(broker, AtomicBroker)
    try:
        (first,) = await broker.publish_atomic([sent])
        (again,) = await broker.publish_atomic([unit(settings, [stream], 3, stream="b")])
    finally:
        await broker.close()
    assert all(r.ok for r in first + again)
    assert await xrange(f"redis://127.0.0.1:{private_redis}/0", stream) == [1, 2, 3]
    [warning] = [r for r in caplog.records if r.getMessage() == "redis.unit_script.unavailable"]
    assert warning.levelno == logging.WARNING
    assert warning.__dict__["broker"] == "partner"
    assert warning.__dict__["grant"] == SCRIPT_GRANTS
    assert "'evalsha'" in warning.__dict__["reason"]
    assert "stored twice" in warning.__dict__["consequence"]


async def test_scripting_granted_later_is_taken_up_without_a_restart(
    private_redis: int, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused the script, a broker writes units by MULTI/EXEC and tries the script again
    ``SCRIPT_RETRY_SECONDS`` later (here at once): still refused, it stays on MULTI/EXEC with
    no second warning; granted since, its units go by script again, and a unit sent twice
    is stored once (MULTI/EXEC would store it twice)."""
    monkeypatch.setattr(_units, "SCRIPT_RETRY_SECONDS", 0.0)
    settings = private_settings(private_redis, "no-scripts")
    stream = f"{PARTNER_KEYS}granted-later"
    caplog.set_level(logging.INFO, logger="brokers.redis._units")
    admin = aioredis.Redis.from_url(f"redis://127.0.0.1:{private_redis}/0")
    broker = create_broker("partner", settings)
    assert isinstance(broker, AtomicBroker)
    try:
        await broker.publish_atomic([unit(settings, [stream], 1, stream="a")])
        await broker.publish_atomic([unit(settings, [stream], 2, stream="a")])  # still refused
        await admin.acl_setuser("no-scripts", enabled=True, commands=SCRIPTING)
        third = unit(settings, [stream], 3, stream="a")
        (stored,) = await broker.publish_atomic([third])
        (again,) = await broker.publish_atomic([third])
    finally:
        await broker.close()
        revoke = [f"-{command[1:]}" for command in SCRIPTING]
        await admin.acl_setuser("no-scripts", enabled=True, commands=revoke)
        await admin.aclose()
    assert all(r.ok for r in stored + again)
    assert await xrange(f"redis://127.0.0.1:{private_redis}/0", stream) == [1, 2, 3]
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("redis.unit")]
    assert said == ["redis.unit_script.unavailable", "redis.unit_script.available"]


async def test_a_member_refused_when_queued_stores_none_of_its_unit_and_is_named(
    private_redis: int,
) -> None:
    settings = private_settings(private_redis, "partner")
    ok, other, denied = f"{PARTNER_KEYS}orders", f"{PARTNER_KEYS}audit", "atomic.denied"
    refused_unit = unit(settings, [ok, denied, ok], 1, stream="a")
    refused, apart = await publish_atomic(
        settings, [refused_unit, unit(settings, [other], 4, stream="b")]
    )
    assert len(set(refused)) == 1
    assert not refused[0].ok and not refused[0].retryable and not refused[0].unreachable
    error = refused[0].error or ""
    assert error.startswith(
        f"atomic unit of 3 refused: member 2 ({refused_unit[1].wire.message_id}): "
        "rejected by Redis: NoPermissionError"
    )
    assert "yet Redis stored" not in error
    assert apart[0].ok
    admin = f"redis://127.0.0.1:{private_redis}/0"
    assert await xrange(admin, ok) == []
    assert await xrange(admin, other) == [4]


async def test_no_memory_left_refuses_the_unit_whole_and_retryable(private_redis: int) -> None:
    settings = private_settings(private_redis, "partner")
    stream = f"{PARTNER_KEYS}oom"
    admin = aioredis.Redis.from_url(f"redis://127.0.0.1:{private_redis}/0")
    try:
        await admin.config_set("maxmemory", 1)  # this module's own server
        try:
            (refused,) = await publish_atomic(
                settings, [unit(settings, [stream] * 2, 1, stream="a")]
            )
        finally:
            await admin.config_set("maxmemory", 0)
        assert await admin.xlen(stream) == 0
    finally:
        await admin.aclose()
    assert len(set(refused)) == 1
    assert not refused[0].ok and refused[0].retryable and not refused[0].unreachable
    assert "atomic unit of 2 refused: member 1" in (refused[0].error or "")
    assert "maxmemory" in (refused[0].error or "")


async def test_without_multi_each_xadd_runs_alone_and_the_unit_says_so(private_redis: int) -> None:
    settings = private_settings(private_redis, "no-multi")
    stream = f"{PARTNER_KEYS}no-multi"
    (refused,) = await publish_atomic(settings, [unit(settings, [stream] * 2, 1, stream="a")])
    assert len(set(refused)) == 1
    error = refused[0].error or ""
    assert not refused[0].ok and not refused[0].retryable
    assert error.startswith("atomic unit of 2 refused whole: rejected by Redis: NoPermission")
    assert "yet Redis stored members 1 (" in error
    assert "(Redis refused MULTI, so each XADD ran alone)" in error
    assert await xrange(f"redis://127.0.0.1:{private_redis}/0", stream) == [1, 2]


async def test_a_unit_over_max_unit_is_refused_unsent(redis_harness: RedisHarness) -> None:
    settings = redis_harness.settings()
    orders = redis_harness.destination("orders")
    too_many, fits = await publish_atomic(
        settings,
        [unit(settings, [orders] * 3, 1, stream="a"), unit(settings, [orders], 4, stream="b")],
        max_unit=2,
    )
    assert set(too_many) == {
        PublishResult.failed(
            "an atomic unit of 3 messages; a Redis transaction (max_unit) holds 2",
            retryable=False,
        )
    }
    assert fits[0].ok
    assert await xrange(REDIS_URL, orders) == [4]


async def test_an_unreachable_redis_raises_broker_unavailable(redis_harness: RedisHarness) -> None:
    settings = redis_harness.unreachable()
    with pytest.raises(BrokerUnavailable, match="connection refused"):
        await publish_atomic(settings, [unit(settings, ["x"], 1, stream="a")])
