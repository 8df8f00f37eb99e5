"""Envelope rendering per profile, and the message ids behind it."""

from __future__ import annotations

import hashlib
import time
import uuid
from datetime import UTC, datetime

import orjson
import pytest

from envelopes import (
    EXTERNAL_FIELDS,
    INTERNAL_ONLY_FIELDS,
    CloudEvent,
    EnvelopeError,
    ExternalEnvelope,
    InternalEnvelope,
    make_internal_envelope,
    render,
    uuid7,
)

PAYLOAD = orjson.dumps({"order_id": "o-1", "note": None, "lines": [{"sku": "A", "qty": 2}]})


def stored(**overrides: object) -> bytes:
    fields: dict[str, object] = {
        "message_id": "01a203f9-08e9-7771-82c9-d8857af1413c",
        "event_type": "order_placed",
        "version": 3,
        "time": datetime(2026, 11, 22, 15, 0, 1, 250000, tzinfo=UTC),
        "source": "shop",
        "payload_json": PAYLOAD,
        "stream": "o-1",
        "correlation_id": "corr",
        "causation_id": "cause",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "tenant": "acme",
        "headers": {"channel": "web"},
        "extensions": {"region": "eu"},
        "event_class": "shop.events.OrderPlaced",
        **overrides,
    }
    return make_internal_envelope(**fields)  # type: ignore[arg-type]


def test_the_stored_envelope_is_the_full_internal_one_with_a_payload_checksum() -> None:
    document = orjson.loads(stored())
    assert document["time"] == "2026-11-22T15:00:01.250000Z"
    assert document["checksum"] == "sha256:" + hashlib.sha256(PAYLOAD).hexdigest()
    assert document["payload"] == orjson.loads(PAYLOAD)
    assert set(document) >= set(InternalEnvelope.model_fields) - {"sequence"}


def test_internal_profile_keeps_everything_plus_the_sequence_but_no_top_level_nulls() -> None:
    wire = render(stored(expected_version=None, priority=None), "internal", sequence=42)
    body = orjson.loads(wire.body)
    InternalEnvelope.model_validate(body)
    assert body["sequence"] == 42
    assert body["tenant"] == "acme"
    assert body["event_class"] == "shop.events.OrderPlaced"
    assert "expected_version" not in body
    assert "priority" not in body
    assert body["payload"]["note"] is None  # nulls inside the payload are the user's data
    assert wire.content_type == "application/json"


def test_external_profile_keeps_only_what_partners_need() -> None:
    wire = render(stored(), "external", sequence=42)
    body = orjson.loads(wire.body)
    ExternalEnvelope.model_validate(body)
    assert set(body) == set(EXTERNAL_FIELDS)
    assert not set(body) & INTERNAL_ONLY_FIELDS


def test_external_profile_drops_absent_fields_instead_of_sending_nulls() -> None:
    wire = render(
        stored(
            stream=None, correlation_id=None, causation_id=None, traceparent=None, extensions=None
        ),
        "external",
    )
    body = orjson.loads(wire.body)
    assert set(body) == {"id", "type", "version", "time", "source", "payload"}
    assert None not in body.values()


def test_omit_removes_fields_from_body_and_headers() -> None:
    wire = render(stored(), "external", omit=["causation_id", "traceparent", "headers"])
    body = orjson.loads(wire.body)
    assert "causation_id" not in body
    assert "traceparent" not in body
    assert "causation-id" not in wire.headers
    assert "traceparent" not in wire.headers
    assert "channel" not in wire.headers


def test_cloudevents_structured_mode() -> None:
    wire = render(stored(), "cloudevents")
    event = orjson.loads(wire.body)
    CloudEvent.model_validate(event)
    assert wire.content_type == "application/cloudevents+json"
    assert event["specversion"] == "1.0"
    assert event["id"] == "01a203f9-08e9-7771-82c9-d8857af1413c"
    assert event["source"] == "shop"
    assert event["type"] == "order_placed"
    assert event["subject"] == "o-1"
    assert event["time"] == "2026-11-22T15:00:01.250000Z"
    assert event["datacontenttype"] == "application/json"
    assert event["correlationid"] == "corr"
    assert event["causationid"] == "cause"
    assert event["region"] == "eu"
    assert event["eventversion"] == 3
    assert event["data"] == orjson.loads(PAYLOAD)
    assert "tenant" not in event


@pytest.mark.parametrize("name", ["Region", "region-code", "id", "x" * 21])
def test_cloudevents_rejects_extension_names_it_cannot_carry(name: str) -> None:
    with pytest.raises(EnvelopeError, match="CloudEvents attribute name"):
        render(stored(extensions={name: "v"}), "cloudevents")


def test_transport_headers_carry_identity_and_user_headers_cannot_override_them() -> None:
    wire = render(stored(headers={"channel": "web", "message-id": "forged"}), "internal")
    assert wire.headers["message-id"] == "01a203f9-08e9-7771-82c9-d8857af1413c"
    assert wire.headers["event-type"] == "order_placed"
    assert wire.headers["event-version"] == "3"
    assert wire.headers["correlation-id"] == "corr"
    assert wire.headers["stream-key"] == "o-1"
    assert wire.headers["channel"] == "web"
    assert wire.message_id == "01a203f9-08e9-7771-82c9-d8857af1413c"
    assert wire.stream_key == "o-1"


def test_a_damaged_stored_envelope_is_an_envelope_error() -> None:
    with pytest.raises(EnvelopeError, match="not valid JSON"):
        render(b"{not json", "internal")
    with pytest.raises(EnvelopeError, match="no 'id'"):
        render(b'{"payload": {}}', "external")


def test_unserialisable_extensions_are_an_envelope_error() -> None:
    with pytest.raises(EnvelopeError, match="not JSON-serialisable"):
        stored(extensions={"when": object()})


def test_uuid7_ids_are_version_7_time_ordered_and_strictly_increasing() -> None:
    before = int(time.time() * 1000)
    ids = [uuid7() for _ in range(10_000)]
    after = int(time.time() * 1000)
    assert all(i.version == 7 for i in ids)
    assert all(i.variant == uuid.RFC_4122 for i in ids)
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)
    stamp = ids[0].int >> 80
    assert before <= stamp <= after + 5
