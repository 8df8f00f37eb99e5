"""A partner reads what arrives with its broker's ordinary client (nats-py, aiokafka,
aio-pika, redis-py, the Azure SDK's session receiver on the Service Bus peer): the rendered
body byte for byte, and every transport header as a native header or property. Redis's
``format: faststream`` (FastStream's own frame) is for the internal broker only."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import orjson
import pytest
from faststream.redis import BinaryMessageFormatV1

from brokers import BrokerSettings, OutgoingMessage, create_broker
from brokers.redis import RedisSettings
from envelopes import WireMessage, make_internal_envelope, render, uuid7
from router import ConfigError, parse_config
from tests.contract.harnesses import Harness, RedisHarness
from tests.services import REDIS, require


def outgoing(settings: BrokerSettings, destination: str) -> OutgoingMessage:
    """One stored event with a correlation id and stream key, rendered for ``settings``."""
    stored = make_internal_envelope(
        message_id=str(uuid7()),
        event_type="order_placed",
        version=2,
        time=datetime.now(UTC),
        source="shop",
        payload_json=orjson.dumps({"order_id": "o-1", "total": "9.90"}),
        stream="order-1",
        correlation_id="corr-1",
        causation_id="cause-1",
    )
    wire = render(stored, settings.profile, sequence=1, omit=settings.omit)
    return OutgoingMessage(destination, wire)


def extra_headers(kind: str, wire: WireMessage) -> dict[str, str]:
    """Headers a partner finds besides the rendered ones: a change here is noticed."""
    if kind == "nats":  # the adapter's: the key of JetStream's duplicate window
        return {"Nats-Msg-Id": wire.message_id}
    if kind == "kafka":  # FastStream's KafkaBroker adds its own
        return {"correlation_id": wire.correlation_id or wire.message_id}
    return {}


def native_properties(kind: str, wire: WireMessage) -> dict[str, str]:
    """What the adapter sets as the broker's own message properties (see each adapter)."""
    if kind == "rabbitmq":
        return {
            "message_id": wire.message_id,
            "correlation_id": wire.correlation_id or "",
            "content_type": wire.content_type,
            "type": wire.event_type,
        }
    if kind == "servicebus":
        return {
            "message_id": wire.message_id,
            "correlation_id": wire.correlation_id or "",
            "subject": wire.event_type,
            "content_type": wire.content_type,
        }
    return {}


@pytest.mark.parametrize("profile", ["external", "cloudevents"])
async def test_a_partner_reads_the_body_and_every_header_with_its_brokers_client(
    harness: Harness, profile: str
) -> None:
    settings = harness.settings(envelope=profile)  # cloudevents: structured mode
    destination = harness.destination()
    await harness.prepare(destination)
    sent = outgoing(settings, destination)
    broker = create_broker("partner", settings)
    try:
        [result] = await broker.publish([sent])
    finally:
        await broker.close()
    assert result.ok, result.error

    [got] = await harness.read_as_a_partner(destination, stream_key="order-1")
    wire = sent.wire
    assert got.body == wire.body
    document = json.loads(got.body)
    assert document["id"] == wire.message_id
    assert wire.headers["correlation-id"] == "corr-1"
    assert wire.headers["stream-key"] == "order-1"
    assert {k: got.headers.get(k) for k in wire.headers} == wire.headers
    extra = {k: v for k, v in got.headers.items() if k not in wire.headers}
    assert extra == extra_headers(harness.kind, wire)
    assert got.properties == native_properties(harness.kind, wire)
    if harness.kind in ("kafka", "servicebus"):
        assert got.key == "order-1"  # partition key / session id


@pytest.fixture
async def redis() -> AsyncIterator[RedisHarness]:
    require("Redis", REDIS)
    harness = RedisHarness()
    yield harness
    await harness.cleanup()


async def test_a_header_named_body_does_not_replace_the_body(redis: RedisHarness) -> None:
    settings = redis.settings()
    destination = redis.destination()
    wire = WireMessage(
        message_id="m-1",
        event_type="order_placed",
        body=b'{"id":"m-1"}',
        content_type="application/json",
        headers={"body": "not the body", "message-id": "m-1"},
    )
    broker = create_broker("partner", settings)
    try:
        [result] = await broker.publish([OutgoingMessage(destination, wire)])
    finally:
        await broker.close()
    assert result.ok, result.error
    assert await redis.entries(destination, 1) == [
        {b"body": b'{"id":"m-1"}', b"message-id": b"m-1"}
    ]


def test_format_faststream_is_refused_on_a_partner_broker() -> None:
    config = """
databases:
  main: sqlite:///outbox.db
brokers:
  events: {type: memory, internal: true}
  cache: {type: redis, format: faststream}
"""
    with pytest.raises(ConfigError) as caught:
        parse_config(config)
    assert "brokers.cache: format: faststream is for the internal broker" in str(caught.value)


def test_each_format_names_the_client_it_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "faststream", None)  # as if it were not installed
    plain = RedisSettings.model_validate({"type": "redis"})
    framed = RedisSettings.model_validate(
        {"type": "redis", "internal": True, "format": "faststream"}
    )
    assert plain.missing_client() is None
    assert framed.missing_client() == (
        "the redis broker needs its client library (faststream is not installed): "
        "pip install 'outbox-router[redis]'"
    )


async def test_the_internal_broker_in_faststream_format_is_read_as_faststream_frames(
    redis: RedisHarness,
) -> None:
    settings = redis.settings(internal=True, format="faststream")
    destination = redis.destination()
    sent = outgoing(settings, destination)
    broker = create_broker("events", settings)
    try:
        [result] = await broker.publish([sent])
    finally:
        await broker.close()
    assert result.ok, result.error

    [fields] = await redis.entries(destination, 1)
    assert set(fields) == {b"__data__"}
    body, headers = BinaryMessageFormatV1.parse(fields[b"__data__"])
    assert body == sent.wire.body
    assert headers == {**sent.wire.headers, "correlation_id": "corr-1"}
