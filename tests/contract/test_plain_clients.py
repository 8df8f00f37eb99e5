"""A partner reads what arrives with its broker's ordinary client (nats-py, aiokafka,
aio-pika, redis-py, the Azure SDK's session receiver on the Service Bus peer): the rendered
body byte for byte, and every transport header as a native header or property. Redis's
``format: faststream`` (FastStream's own frame) is for the internal broker only.

What a broker carries besides the body is a function of the stored event alone: the same row
published again arrives with the same headers and properties, none names the library that
sent it, and the exported contract declares every one of them."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest
import yaml
from faststream.redis import BinaryMessageFormatV1

from brokers import BrokerSettings, OutgoingMessage, create_broker
from brokers.redis import RedisSettings
from envelopes import WireMessage, make_internal_envelope, render, uuid7
from router import ConfigError, Event, parse_config
from router.ops.contract import asyncapi_document, partner_messages
from router.write.catalog import EventCatalog
from tests.contract.harnesses import REPLAY_GAP, Arrived, Harness, RedisHarness

EVENT_TIME = datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)  # long before any publish


def outgoing(settings: BrokerSettings, destination: str) -> OutgoingMessage:
    """One stored event with a correlation id and stream key, rendered for ``settings``."""
    stored = make_internal_envelope(
        message_id=str(uuid7()),
        event_type="order_placed",
        version=2,
        time=EVENT_TIME,
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
    if kind == "kafka":  # when one is staged, under the name FastStream's consumers read
        return {"correlation_id": wire.correlation_id} if wire.correlation_id else {}
    return {}


def native_properties(kind: str, wire: WireMessage, time: datetime) -> dict[str, str]:
    """The broker's own message properties, as docs/partners.md lists them."""
    if kind == "rabbitmq":
        return {
            "message_id": wire.message_id,
            "correlation_id": wire.correlation_id or "",
            "content_type": wire.content_type,
            "type": wire.event_type,
            "delivery_mode": "2",
            "timestamp": str(int(time.timestamp())),
        }
    if kind == "kafka":
        return {"key": wire.stream_key or "", "timestamp": str(int(time.timestamp() * 1000))}
    if kind == "servicebus":
        return {
            "message_id": wire.message_id,
            "correlation_id": wire.correlation_id or "",
            "subject": wire.event_type,
            "content_type": wire.content_type,
            "session_id": wire.stream_key or "",
        }
    return {}


def texts(properties: dict[str, str | int]) -> dict[str, str]:
    return {name: str(value) for name, value in properties.items()}


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
    assert got.properties == native_properties(harness.kind, wire, EVENT_TIME)
    # What the settings say the message carries, for router preview, is what it carries.
    assert got.headers == settings.native_headers(wire)
    assert got.properties == texts(settings.native_properties(wire))
    if harness.kind in ("kafka", "servicebus"):
        assert got.key == "order-1"  # partition key / session id


class OrderPlaced(Event, type="order_placed", version=2, published=True):
    """An order was placed."""

    order_id: str
    total: str


REPLAYED = [
    pytest.param({"envelope": "external"}, id="external"),
    pytest.param({"envelope": "cloudevents", "cloudevents_mode": "binary"}, id="ce-binary"),
]


async def published_twice(harness: Harness, settings: BrokerSettings) -> list[Arrived]:
    """One stored row, without a correlation id, published twice by two adapters (as a
    requeue or a replay does): both arrivals, as the partner's client reads them."""
    destination = harness.destination("replayed")
    await harness.prepare(destination)
    stored = make_internal_envelope(
        message_id=str(uuid7()),
        event_type="order_placed",
        version=2,
        time=EVENT_TIME,
        source="shop",
        payload_json=orjson.dumps({"order_id": "o-1", "total": "9.90"}),
        stream="order-1",
    )
    for attempt in range(2):
        broker = create_broker("partner", settings)
        try:
            [result] = await broker.publish(
                [OutgoingMessage(destination, settings.render(stored, sequence=1))]
            )
        finally:
            await broker.close()
        assert result.ok, result.error
        if attempt == 0:
            await asyncio.sleep(REPLAY_GAP)
    arrived = await harness.arrived(destination, 2)
    assert len(arrived) == 2
    return arrived


@pytest.mark.parametrize("profile", REPLAYED)
async def test_the_same_row_published_twice_arrives_with_the_same_headers_and_properties(
    harness: Harness, profile: dict[str, Any]
) -> None:
    settings = harness.replay_settings(**profile)

    first, again = await published_twice(harness, settings)

    assert (again.body, again.headers, again.properties) == (
        first.body,
        first.headers,
        first.properties,
    )
    # Nothing made up for the correlation id that was not staged; the time is the event's.
    assert not {"correlation_id", "correlation-id"} & (first.headers.keys() | first.properties)
    if harness.kind == "rabbitmq":
        assert first.properties["timestamp"] == str(int(EVENT_TIME.timestamp()))
    if harness.kind == "kafka":
        assert first.properties["timestamp"] == str(int(EVENT_TIME.timestamp() * 1000))


@pytest.mark.parametrize("profile", REPLAYED)
async def test_nothing_on_the_wire_names_the_library_that_sent_it(
    harness: Harness, profile: dict[str, Any]
) -> None:
    [got, _] = await published_twice(harness, harness.replay_settings(**profile))

    texts = [*got.headers.items(), *got.properties.items()]
    assert [(k, v) for k, v in texts if "faststream" in f"{k}={v}".lower()] == []


@pytest.mark.parametrize("profile", REPLAYED)
async def test_every_header_and_property_on_the_wire_is_in_the_exported_contract(
    harness: Harness, profile: dict[str, Any]
) -> None:
    settings = harness.replay_settings(**profile)
    message = exported_message(harness, profile)
    [got, _] = await published_twice(harness, settings)

    headers = message["headers"]
    patterns = [re.compile(p) for p in headers.get("patternProperties", {})]
    undeclared = [
        name
        for name in got.headers
        if name not in headers["properties"] and not any(p.search(name) for p in patterns)
    ]
    assert undeclared == []
    assert set(headers["required"]) <= got.headers.keys()
    properties = message.get("x-properties", {"properties": {}, "required": []})
    assert set(got.properties) <= properties["properties"].keys()
    assert set(properties["required"]) <= got.properties.keys()


def exported_message(harness: Harness, profile: dict[str, Any]) -> dict[str, Any]:
    """The AsyncAPI message ``router contract export`` writes for this partner's event."""
    config = {
        "service": "shop",
        "databases": {"main": "sqlite:///contract.db"},
        "brokers": {
            "events": {"type": "memory", "internal": True},
            "partner": harness.config(**profile),
        },
    }
    catalog = EventCatalog()
    catalog.classes["order_placed"] = {2: OrderPlaced}
    parsed = parse_config(yaml.safe_dump(config), env={})
    document = asyncapi_document("shop", "1", partner_messages(parsed, catalog))
    [message] = document["components"]["messages"].values()
    return dict(message)


async def test_a_header_named_body_does_not_replace_the_body(redis_harness: RedisHarness) -> None:
    settings = redis_harness.settings()
    destination = redis_harness.destination()
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
    assert await redis_harness.entries(destination, 1) == [
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
    redis_harness: RedisHarness,
) -> None:
    settings = redis_harness.settings(internal=True, format="faststream")
    destination = redis_harness.destination()
    sent = outgoing(settings, destination)
    broker = create_broker("events", settings)
    try:
        [result] = await broker.publish([sent])
    finally:
        await broker.close()
    assert result.ok, result.error

    [fields] = await redis_harness.entries(destination, 1)
    assert set(fields) == {b"__data__"}
    body, headers = BinaryMessageFormatV1.parse(fields[b"__data__"])
    assert body == sent.wire.body
    assert headers == {**sent.wire.headers, "correlation_id": "corr-1"}
