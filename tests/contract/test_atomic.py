"""``atomic: true``, through the relay, on every broker with an atomic write: JetStream (the
embedded nats-server, 2.12 or later: the shared one is older), Redis and the Service Bus peer.

The rows one application transaction staged for a target go as one unit: stored together, in
order, apart from other transactions' rows, all or none, with one verdict (docs/guarantees.md,
"Atomic transactions"). Run on PostgreSQL, which records each row's transaction, and on SQLite
and MariaDB, where ``stage()`` records it (migration 0019).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import nats
import orjson
import pytest
import sqlalchemy as sa
from nats.js.api import StorageType, StreamConfig

from brokers.nats import EmbeddedNats
from brokers.redis._script import MARKER_PREFIX
from envelopes import message_id_of
from router.ops.outbox import trace
from router.ops.schema import outbox
from router.serve.runner import Runner
from tests.conftest import Database, make_config
from tests.contract.harnesses import Arrived, Harness, NatsHarness, RedisHarness, harness_for
from tests.contract.test_contract import settled
from tests.integration.events import OrderPlaced
from tests.peers.redis import private_redis
from tests.services import free_port

pytestmark = pytest.mark.parametrize("database", ["postgresql", "sqlite", "mysql"], indirect=True)

# The Redis user the router publishes as may write the harness's keys (c<tag>.*) and the
# units' markers only, by script or in a transaction: a member bound elsewhere is refused
# before anything of its unit is stored.
REDIS_KEYS = ("c*", f"{MARKER_PREFIX}*")
REDIS_COMMANDS = ("+xadd", "+multi", "+exec", "+evalsha", "+eval", "+get", "+set", "+type")
REDIS_DENIED = "denied.orders"
# JetStream refuses a member larger than this (the stream's max_msg_size).
NATS_MAX_MESSAGE = 4096

Refuse = Callable[[Database, str], Awaitable[None]]
"""Make the broker refuse the row of one message id for good (its row is changed in place)."""


@dataclass
class Atomic:
    harness: Harness
    refuse: Refuse


@pytest.fixture(params=["nats", "redis", "servicebus"])
async def atomic(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Atomic]:
    kind: str = request.param
    if kind == "nats":
        url = f"nats://127.0.0.1:{free_port()}"
        server = EmbeddedNats(url, tmp_path / "nats")
        await server.start()
        jetstream = NatsHarness(url)
        try:
            await _small_messages_stream(jetstream)
            yield Atomic(jetstream, _too_large)
        finally:
            await jetstream.cleanup()
            await server.stop()
    elif kind == "redis":
        with private_redis([("partner", *REDIS_COMMANDS)], REDIS_KEYS) as port:
            reader = f"redis://127.0.0.1:{port}/0"
            redis = RedisHarness(f"redis://partner@127.0.0.1:{port}/0", reader)
            yield Atomic(redis, _bound_for(REDIS_DENIED))
    else:
        async with harness_for(kind, request) as harness:
            # A unit is one batch to one entity: a member bound for another is refused whole.
            yield Atomic(harness, _bound_for(harness.rejected_destination()))


async def _small_messages_stream(harness: NatsHarness) -> None:
    """The harness's stream, made before the router connects, with atomic batches allowed
    and small messages only."""
    client = await nats.connect(harness.url)
    try:
        await client.jetstream().add_stream(
            StreamConfig(
                name=harness.stream,
                subjects=[harness.destination(">")],
                storage=StorageType.MEMORY,
                allow_atomic=True,
                max_msg_size=NATS_MAX_MESSAGE,
            )
        )
    finally:
        await client.close()


async def _too_large(database: Database, message_id: str) -> None:
    [row] = [r for r in await database.rows() if r["message_id"] == message_id]
    envelope = row["envelope"]
    envelope["payload"]["note"] = "x" * (2 * NATS_MAX_MESSAGE)
    update = sa.update(outbox).where(outbox.c.message_id == message_id)
    await database.execute(update.values(envelope=sa.literal(envelope, type_=sa.JSON)))


def _bound_for(destination: str) -> Refuse:
    async def refuse(database: Database, message_id: str) -> None:
        update = sa.update(outbox).where(outbox.c.message_id == message_id)
        await database.execute(update.values(destination=destination))

    return refuse


def _order(n: int, **fields: Any) -> OrderPlaced:
    return OrderPlaced(order_id=str(n), total=Decimal(n), **fields)


def _ids(arrived: list[Arrived]) -> list[str]:
    return [str(message_id_of(a.body, a.headers, native_id=a.native_id)) for a in arrived]


async def test_one_transactions_events_are_stored_together_and_apart_from_another(
    atomic: Atomic, database: Database
) -> None:
    """The issue's case: three events of one transaction on one key, and one event of another
    transaction committed while the first was still open, staged between its first and second
    event. Without ``atomic`` they arrive 1, 4, 2, 3 (the n-th row of each stream goes in the
    n-th wave); with it, 4 (its transaction committed first) and then 1, 2, 3 together, each
    once, each naming its transaction (``transaction-id``, ``transaction-size``), each row
    with the broker's receipt; on JetStream 1, 2 and 3 share one Nats-Batch-Id, at
    contiguous sequences.

    SQLite has one writer: the other transaction cannot stage while the first is open, so
    there it commits after the first, and arrives after it."""
    harness = atomic.harness
    brokers = {"events": harness.config(internal=True, atomic=True)}
    writer = database.outbox(brokers)
    one_writer = database.kind == "sqlite"
    try:
        async with writer.transaction() as first:
            ids = await first.stage(_order(1), stream_keys=["k"])
            if not one_writer:
                async with writer.transaction() as second:
                    other = await second.stage(_order(4), stream_keys=["other"])
            ids += await first.stage(_order(2), _order(3), stream_keys=["k", "k"])
        if one_writer:
            async with writer.transaction() as second:
                other = await second.stage(_order(4), stream_keys=["other"])
    finally:
        await writer.close()
    seqs = {str(r["message_id"]): r["seq"] for r in await database.rows()}
    staged = (*ids, other[0]) if one_writer else (ids[0], other[0], ids[1], ids[2])
    assert [seqs[i] for i in staged] == sorted(seqs.values())

    arrived, rows = await _serve(harness, database, brokers, arriving=4)

    assert _ids(arrived) == ([*ids, other[0]] if one_writer else [other[0], *ids])
    assert [r["status"] for r in rows] == ["published"] * 4
    # Each message names its transaction (its first event's id) and the transaction's size.
    bounds = [
        (
            a.headers.get("transaction-id") or a.properties.get("transaction-id"),
            a.headers.get("transaction-size") or a.properties.get("transaction-size"),
        )
        for a in arrived
    ]
    whole, apart = [(ids[0], "3")] * 3, [(other[0], "1")]
    assert bounds == (whole + apart if one_writer else apart + whole)
    receipts = {
        str(r["message_id"]): r["receipt"]
        for r in await database.fetch("SELECT message_id, receipt FROM router_outbox")
    }
    if harness.kind == "servicebus":  # its acknowledgement names no position
        return
    assert all(receipts.values()), receipts
    if harness.kind == "nats":
        unit = arrived[:3] if one_writer else arrived[1:]
        batch = {a.headers.get("Nats-Batch-Id") for a in unit}
        assert len(batch) == 1 and None not in batch
        sequences = [a.position["seq"] for a in unit if a.position]
        assert sequences == list(range(sequences[0], sequences[0] + 3))
        members = [orjson.loads(receipts[i]) for i in ids]
        assert [m["seq"] for m in members] == sequences
        assert {m["batch"] for m in members} == batch
        # `router trace` shows each member's own position.
        config = make_config({"main": database.url}, brokers, database.base_dir)
        assert [(await trace(config, i))[0].receipt for i in ids] == members


async def test_a_transaction_with_a_member_refused_for_good_stores_none_of_it(
    atomic: Atomic, database: Database
) -> None:
    """Three events of one transaction, the broker refusing the second for good, and an event
    of another transaction: the other arrives; none of the three does. All three are
    abandoned (``ordering: skip``) with one error naming the second."""
    harness = atomic.harness
    brokers = {"events": harness.config(internal=True, atomic=True)}
    writer = database.outbox(brokers)
    try:
        async with writer.transaction() as tx:
            ids = await tx.stage(_order(1), _order(2), _order(3), stream_keys=["k", "k", "j"])
        async with writer.transaction() as tx:
            other = await tx.stage(_order(4), stream_keys=["other"])
    finally:
        await writer.close()
    await atomic.refuse(database, ids[1])

    arrived, rows = await _serve(harness, database, brokers, arriving=1)

    assert _ids(arrived) == other
    errors = await database.fetch("SELECT message_id, status, last_error FROM router_outbox")
    by_id = {str(r["message_id"]): r for r in errors}
    assert [by_id[i]["status"] for i in ids] == ["abandoned"] * 3
    assert len({by_id[i]["last_error"] for i in ids}) == 1
    assert f"member 2 ({ids[1]})" in by_id[ids[0]]["last_error"]
    assert by_id[other[0]]["status"] == "published"
    assert len(rows) == 4


async def _serve(
    harness: Harness, database: Database, brokers: dict[str, Any], *, arriving: int
) -> tuple[list[Arrived], list[dict[str, Any]]]:
    """Run the router until ``arriving`` messages are at the target's destination and the
    four rows are done with; what arrived, and the rows."""
    config = make_config({"main": database.url}, brokers, database.base_dir)
    runner = Runner(config, broker_factory=harness.broker, start_embedded=False, serve_http=False)
    await runner.start()
    try:
        arrived = await harness.arrived_once(harness.destination("order_placed"), arriving)
        return arrived, await settled(database, 4)
    finally:
        await runner.shutdown()
