"""JetStream atomic batches through the NATS adapter (``NatsBroker.publish_atomic``), against
the embedded nats-server (2.12 or later: ADR-50's batches), read back as a consumer would."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import orjson
import pytest
from nats.js.api import StreamConfig

from brokers import AtomicBroker, OutgoingMessage, PublishResult
from brokers.nats import EmbeddedNats
from brokers.nats._adapter import MAX_BATCH, NatsBroker
from brokers.settings import NatsSettings
from envelopes import BrokerError, WireMessage
from tests.services import free_port

pytestmark = pytest.mark.asyncio


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[str]:
    url = f"nats://127.0.0.1:{free_port()}"
    embedded = EmbeddedNats(url, tmp_path / "nats")
    await embedded.start()
    try:
        yield url
    finally:
        await embedded.stop()


def settings(url: str, *, atomic: bool = False, **stream: Any) -> NatsSettings:
    return NatsSettings.model_validate(
        {
            "type": "nats",
            "url": url,
            "atomic": atomic,
            "stream": {"name": "ATOMIC", "subjects": ["orders.>"], **stream},
        }
    )


# A stream needs atomic batches allowed for either setting: the stream's own, or the broker's
# atomic (which the relay's units need).
WANTS_ATOMIC = pytest.mark.parametrize(
    ("wanted", "why"),
    [({"allow_atomic": True}, "stream.allow_atomic is on"), ({"atomic": True}, "atomic is on")],
    ids=["allow_atomic", "atomic"],
)


def message(n: int, *, size: int = 0, key: str = "k") -> OutgoingMessage:
    body = orjson.dumps({"n": n, "pad": "x" * size})
    wire = WireMessage(
        message_id=str(uuid.UUID(int=n)),
        event_type="order_placed",
        body=body,
        content_type="application/json",
        stream_key=key,
    )
    return OutgoingMessage("orders.placed", wire)


async def stored(url: str) -> list[tuple[int, dict[str, str], int]]:
    """The stream's messages: (sequence, headers, the body's n), in stream order."""
    client = await nats.connect(url)
    try:
        js = client.jetstream()
        info = await js.stream_info("ATOMIC")
        found = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            if info.state.messages == 0:
                break
            msg = await js.get_msg("ATOMIC", seq)
            found.append((seq, dict(msg.headers or {}), orjson.loads(msg.data or b"{}")["n"]))
        return found
    finally:
        await client.close()


async def test_units_of_one_call_are_stored_together_in_one_batch_at_contiguous_sequences(
    server: str,
) -> None:
    # A batch per unit would sync the stream's store once per unit; units of one call share
    # a batch, all or none, each its own verdict.
    broker = NatsBroker("partner", settings(server, allow_atomic=True))
    assert isinstance(broker, AtomicBroker)
    try:
        results = await broker.publish_atomic(
            [[message(1), message(2), message(3)], [message(4, key="other")]]
        )
    finally:
        await broker.close()
    assert [[r.ok for r in unit] for unit in results] == [[True, True, True], [True]]
    receipts = [orjson.loads(r.receipt or "{}") for unit in results for r in unit]
    assert [r["seq"] for r in receipts] == [1, 2, 3, 4]
    assert {r["count"] for r in receipts} == {4}
    assert len({r["batch"] for r in receipts}) == 1
    messages = await stored(server)
    assert [(seq, n) for seq, _, n in messages] == [(1, 1), (2, 2), (3, 3), (4, 4)]
    batch_ids = {headers["Nats-Batch-Id"] for _, headers, _ in messages}
    assert batch_ids == {receipts[0]["batch"]}
    assert [h.get("Nats-Batch-Commit") for _, h, _ in messages] == [None, None, None, "1"]
    assert [headers["Nats-Msg-Id"] for _, headers, _ in messages] == [
        str(uuid.UUID(int=n)) for n in (1, 2, 3, 4)
    ]


async def test_a_batch_holding_a_unit_stored_before_is_sent_again_unit_by_unit(
    server: str,
) -> None:
    """The first unit was stored alone; sent again with a new one in one batch, JetStream
    refuses the whole batch (10201): each unit then goes alone, the first recognised as
    stored, the second stored. Each message is in the stream once."""
    broker = NatsBroker("partner", settings(server, allow_atomic=True))
    first, second = [message(1), message(2)], [message(3, key="other")]
    try:
        await broker.publish_atomic([first])
        stored_before, new = await broker.publish_atomic([first, second])
    finally:
        await broker.close()
    assert all(r.ok for r in stored_before) and all(r.ok for r in new)
    assert all('"batch_stored":true' in (r.receipt or "") for r in stored_before)
    assert orjson.loads(new[0].receipt or "{}")["seq"] == 3
    assert [n for _, _, n in await stored(server)] == [1, 2, 3]


async def test_a_member_refused_for_good_stores_none_and_names_the_member(server: str) -> None:
    client = await nats.connect(server)
    try:
        await client.jetstream().add_stream(
            StreamConfig(name="ATOMIC", subjects=["orders.>"], allow_atomic=True, max_msg_size=2048)
        )
    finally:
        await client.close()
    broker = NatsBroker("partner", settings(server, allow_atomic=True, create=False))
    try:
        (unit, apart) = await broker.publish_atomic(
            [[message(1), message(2, size=4096), message(3)], [message(4, key="other")]]
        )
    finally:
        await broker.close()
    assert len(set(unit)) == 1, "one verdict for the whole unit"
    verdict = unit[0]
    assert not verdict.ok and not verdict.retryable and not verdict.unreachable
    assert f"member 2 ({uuid.UUID(int=2)})" in (verdict.error or "")
    assert "message size exceeds maximum" in (verdict.error or "")
    assert apart[0].ok
    assert [n for _, _, n in await stored(server)] == [4]


async def test_a_unit_sent_again_is_recognised_as_stored(server: str) -> None:
    broker = NatsBroker("partner", settings(server, allow_atomic=True))
    unit = [message(1), message(2), message(3)]
    try:
        (first,) = await broker.publish_atomic([unit])
        (again,) = await broker.publish_atomic([unit])  # as after a lost commit answer
    finally:
        await broker.close()
    assert all(r.ok for r in first) and all(r.ok for r in again)
    assert all(orjson.loads(r.receipt or "{}").get("duplicate") for r in again)
    assert [n for _, _, n in await stored(server)] == [1, 2, 3]


async def test_a_unit_over_the_batch_limit_is_refused_unsent(server: str) -> None:
    broker = NatsBroker("partner", settings(server, allow_atomic=True))
    try:
        (unit,) = await broker.publish_atomic([[message(n) for n in range(MAX_BATCH + 1)]])
    finally:
        await broker.close()
    assert set(unit) == {
        PublishResult.failed(
            f"an atomic unit of {MAX_BATCH + 1:,} messages; a JetStream batch holds {MAX_BATCH:,}",
            retryable=False,
        )
    }
    assert await stored(server) == []


@WANTS_ATOMIC
async def test_a_stream_without_atomic_publish_is_refused_at_connect(
    server: str, wanted: dict[str, bool], why: str
) -> None:
    client = await nats.connect(server)
    try:
        await client.jetstream().add_stream(StreamConfig(name="ATOMIC", subjects=["orders.>"]))
    finally:
        await client.close()
    broker = NatsBroker("partner", settings(server, **wanted))
    with pytest.raises(BrokerError, match=f"does not allow atomic batch publish \\({why}\\)"):
        await broker.connect()
    await broker.close()


@WANTS_ATOMIC
async def test_the_router_creates_its_stream_with_atomic_publish(
    server: str, wanted: dict[str, bool], why: str
) -> None:
    broker = NatsBroker("partner", settings(server, **wanted))
    try:
        await broker.connect()
    finally:
        await broker.close()
    client = await nats.connect(server)
    try:
        info = await client.jetstream().stream_info("ATOMIC")
    finally:
        await client.close()
    assert info.config.allow_atomic is True
