"""The CloudEvents profile as the CloudEvents SDK reads it: each broker kind's rendering, in
structured mode and in binary mode with its headers, parsed by the SDK's binding for that
transport (``cloudevents`` 2.x, ``cloudevents.core.bindings``), gives back the event."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import orjson
import pytest
from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.bindings import amqp, http, kafka

from envelopes import WireMessage, make_internal_envelope, render, uuid7
from router import parse_config

MESSAGE_ID = str(uuid7())
TIME = datetime(2026, 11, 22, 15, 0, 1, 250000, tzinfo=UTC)
PAYLOAD = {"order_id": "o-1", "total": "12.30", "lines": [{"sku": "SKU-42", "quantity": 2}]}
EXTENSIONS = {"region": "eu", "tier": "gold"}
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

CONFIG = """
databases: {main: "sqlite:///x.db"}
brokers:
  events: {type: memory, internal: true}
  nats:
    type: nats
    stream: {name: SHOP, subjects: ["shop.>"]}
    envelope: cloudevents
    expose: {extensions: ["*"]}
%(mode)s
  kafka:
    type: kafka
    bootstrap_servers: 127.0.0.1:9092
    envelope: cloudevents
    expose: {extensions: ["*"]}
%(mode)s
  rabbitmq:
    type: rabbitmq
    exchange: {name: shop}
    envelope: cloudevents
    expose: {extensions: ["*"]}
%(mode)s
  servicebus:
    type: servicebus
    connection_string: "Endpoint=sb://shop.servicebus.windows.net/;SharedAccessKeyName=k;SharedAccessKey=s"
    envelope: cloudevents
    expose: {extensions: ["*"]}
%(mode)s
"""
KINDS = ("nats", "kafka", "rabbitmq", "servicebus")


def rendered(kind: str, mode: str) -> WireMessage:
    """An event as broker ``kind`` with ``cloudevents_mode: mode`` sends it."""
    config = parse_config(CONFIG % {"mode": f"    cloudevents_mode: {mode}"}, env={})
    settings = config.brokers[kind]
    stored = make_internal_envelope(
        message_id=MESSAGE_ID,
        event_type="order_placed",
        version=2,
        time=TIME,
        source="shop",
        payload_json=orjson.dumps(PAYLOAD),
        stream="o-1",
        correlation_id="corr-1",
        causation_id="cause-1",
        traceparent=TRACEPARENT,
        tenant="acme",
        extensions=EXTENSIONS,
        headers={"x-internal": "never"},
    )
    return render(
        stored,
        settings.profile,
        sequence=7,
        omit=frozenset(settings.omit),
        cloudevents_prefix=settings.binary_prefix,
        exposure=settings.exposure,
    )


def parsed(kind: str, wire: WireMessage) -> BaseCloudEvent:
    """The message as a consumer on that transport hands it to the SDK: NATS headers read
    like HTTP ones (the same ce- prefix), Kafka headers as bytes, AMQP application properties
    with the content type as a message property."""
    if kind == "nats":
        return http.from_http_event(http.HTTPMessage(headers=wire.headers, body=wire.body))
    if kind == "kafka":
        headers = {name: value.encode() for name, value in wire.headers.items()}
        return kafka.from_kafka_event(
            kafka.KafkaMessage(headers=headers, key=wire.stream_key, value=wire.body)
        )
    message = amqp.AMQPMessage(
        properties={"content-type": wire.content_type},
        application_properties=dict(wire.headers),
        application_data=wire.body,
    )
    return amqp.from_amqp_event(message)


def assert_the_event(event: BaseCloudEvent, *, binary: bool) -> None:
    assert event.get_specversion() == "1.0"
    assert (event.get_id(), event.get_source(), event.get_type()) == (
        MESSAGE_ID,
        "shop",
        "order_placed",
    )
    assert event.get_time() == TIME
    assert event.get_subject() == "o-1"
    assert event.get_datacontenttype() == "application/json"
    assert event.get_data() == PAYLOAD
    # Binary mode carries every attribute as a string; the SDK cannot know eventversion's type.
    assert event.get_extension("eventversion") == ("2" if binary else 2)
    assert event.get_extension("correlationid") == "corr-1"
    assert event.get_extension("causationid") == "cause-1"
    assert event.get_extension("traceparent") == TRACEPARENT
    for name, value in EXTENSIONS.items():
        assert event.get_extension(name) == value
    # Nothing internal-only becomes an attribute.
    attributes = event.get_attributes()
    assert not {"tenant", "sequence", "checksum", "headers", "x-internal"} & set(attributes)


@pytest.mark.parametrize("kind", KINDS)
def test_the_sdk_reads_a_structured_cloudevent(kind: str) -> None:
    wire = rendered(kind, "structured")

    assert wire.content_type == "application/cloudevents+json"
    event = parsed(kind, wire)

    assert_the_event(event, binary=False)


@pytest.mark.parametrize("kind", KINDS)
def test_the_sdk_reads_a_binary_cloudevent_from_its_headers(kind: str) -> None:
    wire = rendered(kind, "binary")

    assert wire.content_type == "application/json"
    assert orjson.loads(wire.body) == PAYLOAD
    event = parsed(kind, wire)

    assert_the_event(event, binary=True)


PREFIXES = {"nats": "ce-", "kafka": "ce_", "rabbitmq": "cloudEvents:", "servicebus": "cloudEvents:"}


@pytest.mark.parametrize("kind", KINDS)
def test_binary_mode_carries_the_content_type_as_the_bindings_say(kind: str) -> None:
    """datacontenttype maps to the message's content type (the content-type header, the AMQP
    content_type property), not to a prefixed header of its own."""
    wire = rendered(kind, "binary")
    prefix = PREFIXES[kind]

    assert wire.headers["content-type"] == wire.content_type == "application/json"
    assert prefix + "datacontenttype" not in wire.headers
    assert {prefix + "id", prefix + "specversion", prefix + "type"} <= wire.headers.keys()


def test_the_structured_body_is_what_the_sdk_writes_back() -> None:
    wire = rendered("nats", "structured")
    event = parsed("nats", wire)

    written = http.to_structured_event(event)

    sent: dict[str, Any] = orjson.loads(wire.body)
    assert orjson.loads(written.body) == sent
