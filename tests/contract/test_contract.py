"""The broker contract, written once and run against every adapter over a real peer:
NATS JetStream, Kafka (tansu), RabbitMQ, Redis Streams and Azure Service Bus (the AMQP 1.0
peer driven by the unchanged azure-servicebus SDK).

A test that says its messages arrive once reads them with ``harness.arrived_once`` and
publishes through ``harness.broker``: with ``CONTRACT_DELIVER_TWICE=1`` each of them must
fail (tests/contract/harnesses.py)."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import orjson
import pytest
import sqlalchemy as sa

from brokers import Broker, BrokerSettings, OutgoingMessage, create_broker
from envelopes import (
    MAX_SKIPPED_NAMED,
    BrokerUnavailable,
    PublishError,
    make_internal_envelope,
    message_id_of,
    render,
    uuid7,
)
from router.ops.audit import history
from router.ops.held import release
from router.ops.schema import gaps, outbox
from router.serve.runner import Runner
from tests.conftest import Database, make_config
from tests.contract.harnesses import Arrived, Harness
from tests.integration.events import OrderPlaced


def message(
    settings: BrokerSettings, destination: str, n: int, *, stream: str | None, size: int = 0
) -> OutgoingMessage:
    stored = make_internal_envelope(
        message_id=str(uuid7()),
        event_type="order_placed",
        version=2,
        time=datetime.now(UTC),
        source="shop",
        payload_json=orjson.dumps({"n": n, "pad": "x" * size}),
        stream=stream,
        correlation_id=f"corr-{n}",
        causation_id="cause",
        headers={"channel": "web"},
        extensions={"region": "eu"},
    )
    wire = render(
        stored,
        settings.profile,
        sequence=n,
        omit=settings.omit,
        cloudevents_prefix=settings.binary_prefix,
        exposure=settings.exposure,
    )
    return OutgoingMessage(destination, wire)


async def publish(broker: Broker, batch: list[OutgoingMessage]) -> list[Any]:
    try:
        return await broker.publish(batch)
    finally:
        await broker.close()


# Partners get staged headers and extensions only when their allow-list names them.
SHARED = {"headers": ["channel"], "extensions": ["region"]}
PROFILES = [
    pytest.param({"envelope": "internal"}, id="internal"),
    pytest.param({"envelope": "external", "expose": SHARED}, id="external"),
    pytest.param({"envelope": "cloudevents", "expose": SHARED}, id="cloudevents-structured"),
    pytest.param(
        {"envelope": "cloudevents", "cloudevents_mode": "binary", "expose": SHARED},
        id="cloudevents-binary",
    ),
]


@pytest.mark.parametrize("profile", PROFILES)
async def test_a_batch_arrives_complete_and_once_with_identity_headers_and_body(
    harness: Harness, profile: dict[str, Any]
) -> None:
    settings = harness.settings(**profile)
    destination = harness.destination()
    await harness.prepare(destination)
    batch = [message(settings, destination, n, stream=f"order-{n % 2}") for n in range(6)]
    results = await publish(harness.broker("partner", settings), batch)
    assert [r.ok for r in results] == [True] * 6

    arrived = await harness.arrived_once(destination, 6)
    assert len(arrived) == 6
    by_id = {a.headers["message-id"]: a for a in arrived}
    for sent in batch:
        got = by_id[sent.wire.message_id]
        assert got.body == sent.wire.body
        assert got.headers["event-type"] == "order_placed"
        assert got.headers["correlation-id"] == sent.wire.correlation_id
        assert got.headers["channel"] == "web"
        if harness.kind != "redis":  # Redis Streams has no message id of its own
            assert got.native_id == sent.wire.message_id, harness.native_dedup
        if harness.kind in ("kafka", "servicebus"):
            assert got.key == sent.wire.stream_key  # partition key / session id
    first = by_id[batch[0].wire.message_id]
    mode = profile.get("cloudevents_mode", "structured")
    if profile["envelope"] == "cloudevents" and mode == "binary":
        prefix = settings.cloudevents_prefix
        assert json.loads(first.body) == {"n": 0, "pad": ""}
        assert first.headers[prefix + "id"] == batch[0].wire.message_id
        assert first.headers[prefix + "type"] == "order_placed"
        assert first.headers[prefix + "specversion"] == "1.0"
        assert first.headers[prefix + "region"] == "eu"
    elif profile["envelope"] == "cloudevents":
        assert json.loads(first.body)["specversion"] == "1.0"
    else:
        assert json.loads(first.body)["id"] == batch[0].wire.message_id


async def test_each_acknowledged_message_has_the_brokers_receipt(harness: Harness) -> None:
    """The receipt names where the message landed, as the broker holds it: read back with the
    broker's own client at that position. RabbitMQ's confirm names no position, only a time;
    Service Bus's SDK returns nothing, so there is no receipt."""
    settings = harness.settings()
    destination = harness.destination("receipts")
    await harness.prepare(destination)
    batch = [message(settings, destination, n, stream=f"r-{n % 2}") for n in range(4)]
    before = datetime.now(UTC)
    results = await publish(create_broker("partner", settings), batch)
    after = datetime.now(UTC)
    assert [r.ok for r in results] == [True] * 4
    receipts = {m.wire.message_id: r.receipt for m, r in zip(batch, results, strict=True)}
    if harness.kind == "servicebus":
        assert set(receipts.values()) == {None}
        return
    parsed = {mid: json.loads(text) for mid, text in receipts.items() if text is not None}
    assert len(parsed) == 4, receipts
    if harness.kind == "rabbitmq":
        for receipt in parsed.values():
            confirmed = datetime.fromisoformat(receipt["confirmed_at"])
            assert before <= confirmed <= after
        return
    arrived = await harness.arrived(destination, 4)
    positions = {a.headers["message-id"]: a.position for a in arrived}
    assert parsed == {mid: positions[mid] for mid in parsed}


async def test_stream_order_holds_inside_a_batch_each_message_once(harness: Harness) -> None:
    settings = harness.settings()
    destination = harness.destination("ordered")
    await harness.prepare(destination)
    batch = [message(settings, destination, n, stream="order-1") for n in range(25)]
    results = await publish(harness.broker("partner", settings), batch)
    assert all(r.ok for r in results)
    arrived = await harness.arrived_once(destination, 25)
    assert [json.loads(a.body)["payload"]["n"] for a in arrived] == list(range(25))


async def test_two_batches_published_at_once_on_a_new_adapter_all_arrive_once(
    harness: Harness,
) -> None:
    # The processor publishes the next batch while the current one is still in flight, so
    # the first two publishes of a fresh adapter race through connect() (and, for NATS,
    # through creating the stream): neither may go out before the adapter is ready.
    settings = harness.settings()
    destination = harness.destination("together")
    await harness.prepare(destination)
    broker = harness.broker("partner", settings)
    batches = [
        [message(settings, destination, n * 4 + i, stream=None) for i in range(4)]
        for n in range(10)
    ]
    publishes = []
    try:
        for batch in batches:  # staggered, so that some start in the middle of connect()
            publishes.append(asyncio.create_task(broker.publish(batch)))
            await asyncio.sleep(0.002)
        results = await asyncio.gather(*publishes)
    finally:
        await broker.close()
    assert [r.error for batch in results for r in batch if not r.ok] == []
    assert len(await harness.arrived_once(destination, 40)) == 40


async def test_an_unreachable_broker_is_a_retryable_failure(harness: Harness) -> None:
    settings = harness.unreachable()
    broker = create_broker("partner", settings)
    batch = [message(settings, harness.destination(), n, stream=None) for n in range(3)]
    try:
        results = await broker.publish(batch)
    except BrokerUnavailable as exc:
        error, results = str(exc), []
    else:  # an adapter may report per message instead; each must be retryable
        error = "; ".join(r.error or "" for r in results)
    finally:
        await broker.close()
    assert all(not r.ok and r.retryable for r in results)
    assert "unreachable" in error or "cannot connect" in error or "cannot reach" in error


async def test_a_refused_message_fails_alone_and_the_rest_arrive_once(harness: Harness) -> None:
    settings = harness.settings()
    destination = harness.destination("fine")
    await harness.prepare(destination)
    if harness.kind == "kafka":  # Kafka refuses a record over max_request_size
        refused = message(settings, destination, 1, stream=None, size=100_000)
    else:
        rejected = harness.rejected_destination()
        await harness.prepare(rejected)
        refused = message(settings, rejected, 1, stream=None)
    fine = message(settings, destination, 2, stream=None)
    results = await publish(harness.broker("partner", settings), [refused, fine])
    assert not results[0].ok
    assert results[0].retryable is harness.refusal_retryable
    assert results[0].error
    assert results[1].ok  # one refusal does not fail the rest
    assert len(await harness.arrived_once(destination, 1)) == 1


async def test_close_and_reconnect_sends_each_message_once(harness: Harness) -> None:
    settings = harness.settings()
    destination = harness.destination("again")
    await harness.prepare(destination)
    broker = harness.broker("partner", settings)
    try:
        assert (await broker.publish([message(settings, destination, 1, stream=None)]))[0].ok
        await broker.close()
        await broker.close()  # idempotent
        await broker.ping()  # reconnects
        assert (await broker.publish([message(settings, destination, 2, stream=None)]))[0].ok
    finally:
        await broker.close()
    assert len(await harness.arrived_once(destination, 2)) == 2


@pytest.mark.parametrize("batch_size", [100, 2], ids=["one-batch", "batches-of-two"])
async def test_the_message_after_an_abandoned_row_of_its_stream_names_it(
    harness: Harness, database: Database, batch_size: int
) -> None:
    """On one stream key, events 1, 2 and 3, where the broker refuses 2 for good, and event 4
    on another key: 1, 3 and 4 arrive, each once; 3 names 2 (its header, and its internal
    envelope's ``skipped``), 1 and 4 name nothing; 2 is abandoned. In one batch 3 follows 2
    in the next wave; in batches of two, 3 comes in a later batch (on PostgreSQL claimed
    before 2's outcome is marked)."""
    destination = harness.destination("order_placed")  # the settings' {event_type}
    await harness.prepare(destination)
    brokers = {"events": harness.config(internal=True)}
    config = make_config(
        {"main": database.url},
        brokers,
        database.base_dir,
        # RabbitMQ's refusal (unroutable) is retryable: the row is abandoned out of attempts.
        outbox={"batch_size": batch_size, "retry": {"max_attempts": 2, "base_delay": 0.05}},
    )
    # Kafka refuses a record over max_request_size (64 KB here); stage() takes up to 256 KB.
    note = "x" * 100_000 if harness.kind == "kafka" else None
    writer = database.outbox(brokers)
    try:
        async with writer.transaction() as tx:
            ids = await tx.stage(
                *(
                    OrderPlaced(order_id=str(n), total=Decimal(n), note=note if n == 2 else None)
                    for n in (1, 2, 3, 4)
                ),
                stream_keys=["k", "k", "k", "other"],
            )
    finally:
        await writer.close()
    if harness.kind != "kafka":  # the other brokers refuse 2 at a destination of their own
        rejected = harness.rejected_destination()
        await harness.prepare(rejected)
        update = sa.update(outbox).where(outbox.c.message_id == ids[1])
        await database.execute(update.values(destination=rejected))

    runner = Runner(config, broker_factory=harness.broker, start_embedded=False, serve_http=False)
    await runner.start()
    try:
        arrived = await harness.arrived_once(destination, 3)
        rows = await settled(database, 4)
    finally:
        await runner.shutdown()

    got = {str(message_id_of(a.body, a.headers, native_id=a.native_id)): a for a in arrived}
    assert sorted(got) == sorted([ids[0], ids[2], ids[3]])
    on_k = [mid for mid in got if mid in (ids[0], ids[2])]
    assert on_k == [ids[0], ids[2]]  # in order on its stream
    assert _named(got[ids[2]]) == ([ids[1]], [ids[1]])
    assert _named(got[ids[0]]) == _named(got[ids[3]]) == (None, None)
    assert [row["status"] for row in rows] == ["published", "abandoned", "published", "published"]
    assert await database.fetch("SELECT seq FROM router_gaps") == []  # 3 closed 2's gap


async def test_the_message_after_a_long_gap_names_its_oldest_ids_and_counts_them(
    harness: Harness, database: Database
) -> None:
    """A stream whose target abandoned 5,000 rows before its next one: named whole, the ids
    would make a 185 KB header, which RabbitMQ answers by closing the connection and the
    other brokers refuse or choke on, and the row would fail for as long as the gap stays.
    The next message arrives naming the oldest MAX_SKIPPED_NAMED (header and ``skipped``) and
    counting all (``skipped-count``, ``skipped_count``), and the gap closes. The gap's rows
    are written as the relay's marks write them: 5,000 refusals would take minutes a broker."""
    destination = harness.destination("order_placed")  # the settings' {event_type}
    await harness.prepare(destination)
    brokers = {"events": harness.config(internal=True)}
    config = make_config({"main": database.url}, brokers, database.base_dir)
    abandoned = [str(uuid7()) for _ in range(5_000)]
    now = datetime.now(UTC).replace(tzinfo=None)
    marks = [
        {"target": "events", "stream_key": "k", "seq": n - 5_000, "message_id": m}
        | {"abandoned_at": now}
        for n, m in enumerate(abandoned)
    ]
    await database.execute(
        *(sa.insert(gaps).values(marks[i : i + 100]) for i in range(0, 5_000, 100))
    )
    writer = database.outbox(brokers)
    try:
        async with writer.transaction() as tx:
            [staged] = await tx.stage(OrderPlaced(order_id="1", total=Decimal(1)), stream_key="k")
    finally:
        await writer.close()

    runner = Runner(config, broker_factory=harness.broker, start_embedded=False, serve_http=False)
    await runner.start()
    try:
        [arrived] = await harness.arrived_once(destination, 1)
        rows = await settled(database, 1)
    finally:
        await runner.shutdown()

    assert str(message_id_of(arrived.body, arrived.headers, native_id=arrived.native_id)) == staged
    named = abandoned[:MAX_SKIPPED_NAMED]
    assert _named(arrived) == (named, named)
    assert arrived.headers.get("skipped-count") == "5000"
    assert json.loads(arrived.body)["skipped_count"] == 5_000
    assert [row["status"] for row in rows] == ["published"]
    assert await database.fetch("SELECT seq FROM router_gaps") == []  # the whole gap closed


@pytest.mark.parametrize("ordering", ["hold", "park"])
async def test_a_stream_whose_head_is_refused_for_good_waits_as_its_ordering_says(
    harness: Harness, database: Database, ordering: str
) -> None:
    """On one stream key, events 1, 2 and 3, where the broker refuses 2 for good, and event 4
    on another key, on a target with ``ordering: hold`` or ``park``: 1 and 4 arrive, each once,
    and 3 does not; nothing names a gap. Held: 2 is ``held`` and 3 waits, pending. Parked: 2
    and 3 are both ``parked``.

    Then the key is released while the broker still refuses 2: 2 is tried again and kept
    again, and 3 still waits. Once the broker takes 2, a second release delivers 2 and 3,
    each once, in order after 1; each release left an audit row."""
    destination = harness.destination("order_placed")  # the settings' {event_type}
    await harness.prepare(destination)
    brokers = {"events": harness.config(internal=True, ordering=ordering)}
    config = make_config(
        {"main": database.url},
        brokers,
        database.base_dir,
        # RabbitMQ's refusal (unroutable) is retryable: the head is kept out of attempts.
        outbox={"retry": {"max_attempts": 2, "base_delay": 0.05}},
    )
    ids = await _stage_one_refused(harness, database, brokers)

    runner = Runner(config, broker_factory=harness.broker, start_embedded=False, serve_http=False)
    await runner.start()
    try:
        arrived = await harness.arrived_once(destination, 2)
        rows = await _kept(database, ordering)
        await release(config, "events", "k", reason="try again", actor="contract")
        again = await _kept(database, ordering, tried=True)
        await _accept_the_second(harness, database, ids[1], destination)
        await release(config, "events", "k", reason="accepted now", actor="contract")
        everything = await harness.arrived_once(destination, 4)
        done = await settled(database, 4)
    finally:
        await runner.shutdown()

    got = [str(message_id_of(a.body, a.headers, native_id=a.native_id)) for a in arrived]
    assert sorted(got) == sorted([ids[0], ids[3]])
    assert all(_named(a) == (None, None) for a in arrived)
    expected = ["published", KEPT[ordering], BEHIND[ordering], "published"]
    assert [row["status"] for row in rows] == expected
    assert rows[2]["attempts"] == 0  # 3 was never tried
    assert await database.fetch("SELECT seq FROM router_gaps") == []

    # Released while still refused: tried afresh, kept again, 3 still untried.
    assert [row["status"] for row in again] == expected
    assert again[1]["attempts"] >= 1 and again[2]["attempts"] == 0

    # Released once accepted: 2 and 3 arrive once each, after 1, in order.
    on_k = [
        mid
        for a in everything
        if (mid := str(message_id_of(a.body, a.headers, native_id=a.native_id))) != ids[3]
    ]
    assert on_k == ids[:3]
    assert [row["status"] for row in done] == ["published"] * 4
    actions = [a for a in await history(config) if a.action == "release"]
    assert [(a.actor, a.target, a.detail["reason"]) for a in actions] == [
        ("contract", "events", "accepted now"),
        ("contract", "events", "try again"),
    ]


@pytest.mark.parametrize("ordering", ["skip", "hold", "park"])
async def test_an_unreachable_broker_costs_no_attempt_in_any_ordering(
    harness: Harness, database: Database, ordering: str
) -> None:
    """A broker this host cannot reach is no verdict on the rows, whatever the target's
    ordering: with one attempt allowed, none is spent, nothing is abandoned, held or parked,
    and no gap is recorded; the target's circuit opens and its rows wait, pending."""
    settings = harness.unreachable()
    unreachable = settings.model_copy(update={"internal": True, "ordering": ordering})
    brokers = {"events": harness.config_of(unreachable)}
    config = make_config(
        {"main": database.url}, brokers, database.base_dir, outbox={"retry": {"max_attempts": 1}}
    )
    writer = database.outbox(brokers)
    try:
        async with writer.transaction() as tx:
            await tx.stage(
                *(OrderPlaced(order_id=str(n), total=Decimal(n)) for n in (1, 2, 3, 4)),
                stream_keys=["k", "k", "k", "other"],
            )
    finally:
        await writer.close()

    runner = Runner(config, broker_factory=harness.broker, start_embedded=False, serve_http=False)
    await runner.start()
    try:
        circuit = runner.processor("main", "events").circuit
        deadline = time.monotonic() + 20
        while not circuit.is_open and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert circuit.is_open
        await asyncio.sleep(0.5)  # probes, not attempts, from here on
    finally:
        await runner.shutdown()

    rows = await database.rows()
    assert [(row["status"], row["attempts"]) for row in rows] == [("pending", 0)] * 4
    assert await database.fetch("SELECT seq FROM router_gaps") == []


KEPT = {"hold": "held", "park": "parked"}
"""The status of a stream's head that each ordering keeps."""
BEHIND = {"hold": "pending", "park": "parked"}
"""The status of the rows of its stream after it: waiting untried, or parked with it."""


async def _accept_the_second(
    harness: Harness, database: Database, message_id: str, destination: str
) -> None:
    """Make the broker take event 2: at the destination of the others, and on Kafka without
    the note that made it too large."""
    update = sa.update(outbox).where(outbox.c.message_id == message_id)
    if harness.kind != "kafka":
        await database.execute(update.values(destination=destination))
        return
    [row] = [r for r in await database.rows() if r["message_id"] == message_id]
    envelope = row["envelope"]
    envelope["payload"].pop("note", None)
    # As JSON: the column is json on PostgreSQL, which takes no plain text parameter.
    await database.execute(update.values(envelope=sa.literal(envelope, type_=sa.JSON)))


async def _stage_one_refused(
    harness: Harness, database: Database, brokers: dict[str, Any]
) -> list[str]:
    """Stage events 1, 2 and 3 on stream key ``k`` and 4 on ``other``, in one transaction,
    where the harness's broker refuses 2 for good; their message ids."""
    # Kafka refuses a record over max_request_size (64 KB here); stage() takes up to 256 KB.
    note = "x" * 100_000 if harness.kind == "kafka" else None
    writer = database.outbox(brokers)
    try:
        async with writer.transaction() as tx:
            ids = await tx.stage(
                *(
                    OrderPlaced(order_id=str(n), total=Decimal(n), note=note if n == 2 else None)
                    for n in (1, 2, 3, 4)
                ),
                stream_keys=["k", "k", "k", "other"],
            )
    finally:
        await writer.close()
    if harness.kind != "kafka":  # the other brokers refuse 2 at a destination of their own
        rejected = harness.rejected_destination()
        await harness.prepare(rejected)
        update = sa.update(outbox).where(outbox.c.message_id == ids[1])
        await database.execute(update.values(destination=rejected))
    return ids


async def _kept(
    database: Database, ordering: str, *, tried: bool = False, timeout: float = 10
) -> list[dict[str, Any]]:
    """The outbox's rows once 1 and 4 are published, 2 is kept as ``ordering`` says (with
    ``tried``: tried at least once since it was released) and 3 waits behind it."""
    expected = ["published", KEPT[ordering], BEHIND[ordering], "published"]
    deadline = time.monotonic() + timeout
    while True:
        rows = await database.rows()
        done = [r["status"] for r in rows] == expected and (not tried or rows[1]["attempts"])
        if done or time.monotonic() > deadline:
            return rows
        await asyncio.sleep(0.05)


def _named(arrived: Arrived) -> tuple[list[str] | None, list[str] | None]:
    """The gap a message names: its header's ids, and its internal envelope's ``skipped``."""
    header = arrived.headers.get("skipped-message-ids")
    skipped: list[str] | None = json.loads(arrived.body).get("skipped")
    return (header.split(",") if header is not None else None), skipped


async def settled(database: Database, count: int, timeout: float = 10) -> list[dict[str, Any]]:
    """The outbox's rows once none of ``count`` is open any more."""
    deadline = time.monotonic() + timeout
    while True:
        rows = await database.rows()
        done = [r for r in rows if r["status"] in ("published", "abandoned")]
        if len(done) == count or time.monotonic() > deadline:
            return rows
        await asyncio.sleep(0.05)


def test_publish_error_carries_retryable() -> None:
    assert PublishError("x", retryable=False).retryable is False
