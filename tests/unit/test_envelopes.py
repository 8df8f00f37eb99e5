"""Envelope rendering per profile (what a consumer receives), and the message ids behind it."""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta, timezone
from types import MappingProxyType
from typing import Any

import orjson
import pytest

from envelopes import (
    EXTERNAL_FIELDS,
    INTERNAL_ONLY_FIELDS,
    MAX_SKIPPED_NAMED,
    CloudEvent,
    EnvelopeError,
    Exposure,
    ExternalEnvelope,
    InternalEnvelope,
    Profile,
    make_internal_envelope,
    message_id_of,
    render,
    uuid7,
)
from envelopes.metadata import METADATA_DEFAULTS

MESSAGE_ID = "01a203f9-08e9-7771-82c9-d8857af1413c"
PAYLOAD = orjson.dumps({"order_id": "o-1", "note": None, "lines": [{"sku": "A", "qty": 2}]})
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

EVERYTHING: dict[str, Any] = {
    "stream": "o-1",
    "correlation_id": "corr",
    "causation_id": "cause",
    "expected_version": 6,
    "asynchronous": False,
    "priority": 5,
    "positions": {"store": 41},
    "traceparent": TRACEPARENT,
    "tenant": "acme",
    "headers": {"channel": "web"},
    "extensions": {"region": "eu"},
    "event_class": "shop.events.OrderPlaced",
}
# A partner allowed the staged header and every extension (partners get neither by default).
SHARED = Exposure(headers=("channel",), extensions=("*",))
# Two rows abandoned before this one on its stream, oldest first.
GAP = ("01a203f9-0000-7000-8000-000000000001", "01a203f9-0000-7000-8000-000000000002")


def stored(payload: bytes = PAYLOAD, **fields: Any) -> bytes:
    """A stored internal envelope; ``fields`` are make_internal_envelope's optional ones."""
    return make_internal_envelope(
        message_id=MESSAGE_ID,
        event_type="order_placed",
        version=3,
        time=datetime(2026, 11, 22, 15, 0, 1, 250000, tzinfo=UTC),
        source="shop",
        payload_json=payload,
        **fields,
    )


def body(stored_envelope: bytes, profile: Any, **options: Any) -> dict[str, Any]:
    document: dict[str, Any] = orjson.loads(render(stored_envelope, profile, **options).body)
    return document


def test_the_stored_envelope_carries_a_sha256_checksum_of_the_payload_bytes() -> None:
    document = orjson.loads(stored())
    assert document["checksum"] == "sha256:" + hashlib.sha256(PAYLOAD).hexdigest()
    assert document["payload"] == orjson.loads(PAYLOAD)
    assert document["time"] == "2026-11-22T15:00:01.250000Z"
    other = orjson.loads(stored(payload=b'{"order_id":"o-2"}'))
    assert other["checksum"] == "sha256:" + hashlib.sha256(b'{"order_id":"o-2"}').hexdigest()


def generic_envelope(
    time: datetime, payload: bytes, event_class: str | None, metadata: dict[str, Any]
) -> bytes:
    """The stored envelope as first written: every metadata field visited in declaration
    order, the time through isoformat(), the document dumped by orjson."""
    moment = time.astimezone(UTC).replace(tzinfo=None)
    document: dict[str, Any] = {
        "id": MESSAGE_ID,
        "type": "order_placed",
        "version": 3,
        "time": moment.isoformat(timespec="microseconds") + "Z",
        "source": "shop",
    }
    for name, default in METADATA_DEFAULTS.items():
        value = metadata.get(name, default)
        if value is not None and value != {}:
            document[name] = dict(value) if isinstance(value, Mapping) else value
    document["checksum"] = "sha256:" + hashlib.sha256(payload).hexdigest()
    if event_class is not None:
        document["event_class"] = event_class
    document["payload"] = orjson.Fragment(payload)
    return orjson.dumps(document)


class FrozenClock(datetime):
    """A datetime subclass, as freezegun's clock returns (orjson writes none)."""


ENVELOPE_TIMES = [
    datetime(2026, 11, 22, 15, 0, 1, 250000, tzinfo=UTC),
    datetime(2026, 11, 22, 15, 0, 1, tzinfo=UTC),  # orjson would leave the fraction out
    datetime(2026, 11, 22, 15, 0, 1, 7, tzinfo=timezone(timedelta(hours=-5))),
    datetime(1, 1, 1, 0, 0, 0, 1, tzinfo=UTC),
    FrozenClock(2026, 11, 22, 15, 0, 1, 5, tzinfo=UTC),
]
ENVELOPE_METADATA: list[dict[str, Any]] = [
    {},
    {"stream": None},
    {"stream": "order-1"},
    {"stream": 'ordre "été" \\ 注文 \u2028 \x01 🛒'},
    {"stream": "o-1", "correlation_id": "corr", "traceparent": TRACEPARENT},
    {"traceparent": TRACEPARENT, "stream": "o-1", "causation_id": "cause"},  # any order given
    {"stream": "o-1", "correlation_id": None, "asynchronous": True},
    {"stream": "o-1", "asynchronous": False, "priority": 0, "expected_version": 0},
    {"headers": {"channel": "web", 'ké"y': "vä\nlue"}, "tenant": "acme"},
    {"headers": {}, "extensions": {}, "positions": {}},
    {"positions": {"store": 41}, "extensions": {"region": "eu", "n": [1.5, None, {"a": "b"}]}},
    {"extensions": {"at": datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=UTC)}},
    {"extensions": MappingProxyType({"b": 1, "a": 2}), "headers": MappingProxyType({"h": "v"})},
    {name: value for name, value in EVERYTHING.items() if name != "event_class"},
]


@pytest.mark.parametrize("metadata", ENVELOPE_METADATA)
@pytest.mark.parametrize("event_class", [None, "shop.events.OrderPlaced"])
def test_the_stored_envelope_is_byte_for_byte_the_generic_document(
    metadata: dict[str, Any], event_class: str | None
) -> None:
    for moment in ENVELOPE_TIMES:
        for payload in (PAYLOAD, b"{}", '{"note":"\u00e9\\\\"}'.encode()):
            made = make_internal_envelope(
                message_id=MESSAGE_ID,
                event_type="order_placed",
                version=3,
                time=moment,
                source="shop",
                payload_json=payload,
                event_class=event_class,
                **metadata,
            )
            assert made == generic_envelope(moment, payload, event_class, metadata)


def test_unknown_metadata_is_a_type_error_however_often_it_is_given() -> None:
    for _ in range(2):  # once to learn the names given, once as known
        with pytest.raises(TypeError, match=re.escape("unknown metadata ['colour', 'size']")):
            stored(stream="o-1", size=1, colour="red")


def test_internal_profile_keeps_every_field_plus_the_sequence_and_the_gap() -> None:
    document = body(stored(**EVERYTHING), "internal", sequence=42, skipped=GAP)
    # skipped_count only after a gap longer than a message names (the test below).
    assert set(document) == set(InternalEnvelope.model_fields) - {"skipped_count"}
    envelope = InternalEnvelope.model_validate(document)
    assert envelope.sequence == 42
    assert envelope.skipped == list(GAP)
    assert (envelope.expected_version, envelope.asynchronous, envelope.priority) == (6, False, 5)
    assert envelope.positions == {"store": 41}
    assert (envelope.tenant, envelope.event_class) == ("acme", "shop.events.OrderPlaced")
    assert envelope.headers == {"channel": "web"}
    assert envelope.extensions == {"region": "eu"}
    assert envelope.traceparent == TRACEPARENT


def test_internal_profile_drops_nulls_and_empty_maps_but_not_nulls_in_the_payload() -> None:
    document = body(stored(), "internal")
    InternalEnvelope.model_validate(document)
    assert None not in document.values()
    for absent in ("stream", "sequence", "priority", "tenant", "positions", "headers"):
        assert absent not in document
    assert "extensions" not in document
    assert document["payload"]["note"] is None  # the user's data, kept as it is
    assert document["asynchronous"] is True


def test_the_stored_envelope_leaves_absent_fields_out_but_keeps_the_payload() -> None:
    document = orjson.loads(stored(payload=b"{}"))
    assert None not in document.values()
    assert {"stream", "correlation_id", "positions", "headers", "extensions"}.isdisjoint(document)
    assert document["payload"] == {}
    assert document["asynchronous"] is True


def test_the_internal_body_is_the_stored_envelope_with_the_sequence_appended() -> None:
    raw = stored(payload=b'{"total": 1.50,  "note": null}', **EVERYTHING)
    out = render(raw, "internal", sequence=42).body
    # The payload goes out byte for byte, as its checksum was taken.
    assert b'"payload":{"total": 1.50,  "note": null}' in out
    assert orjson.loads(out) == {**orjson.loads(raw), "sequence": 42}
    assert render(raw.decode(), "internal", sequence=42).body == out
    assert render(raw, "internal").body == raw


def test_an_envelope_stored_with_nulls_by_an_earlier_version_renders_the_same() -> None:
    """Rows written before envelopes were stored without nulls are still in outboxes."""
    legacy = {
        **dict.fromkeys(("stream", "correlation_id", "causation_id", "expected_version")),
        **dict.fromkeys(("priority", "positions", "traceparent", "tenant", "event_class")),
        **orjson.loads(stored()),
        "headers": {},
        "extensions": {},
    }
    for profile in ("internal", "external", "cloudevents"):
        old = render(orjson.dumps(legacy), profile, sequence=7)
        new = render(stored(), profile, sequence=7)
        assert orjson.loads(old.body) == orjson.loads(new.body)
        assert old.headers == new.headers


def test_external_profile_keeps_exactly_the_fields_partners_need() -> None:
    document = body(stored(**EVERYTHING), "external", sequence=42, exposure=SHARED)
    assert list(document) == list(EXTERNAL_FIELDS)
    assert not set(document) & INTERNAL_ONLY_FIELDS
    envelope = ExternalEnvelope.model_validate(document)
    assert (envelope.id, envelope.type, envelope.version) == (MESSAGE_ID, "order_placed", 3)
    assert envelope.payload == orjson.loads(PAYLOAD)


def test_external_profile_leaves_absent_fields_out_instead_of_sending_nulls() -> None:
    document = body(stored(), "external")
    ExternalEnvelope.model_validate(document)
    assert set(document) == set(EXTERNAL_FIELDS) - {
        "stream",
        "correlation_id",
        "causation_id",
        "traceparent",
        "extensions",
    }
    assert None not in document.values()


@pytest.mark.parametrize("profile", ["internal", "external"])
def test_omit_removes_fields_from_the_body_and_the_headers(profile: str) -> None:
    omit = ["stream", "causation_id", "traceparent", "headers", "extensions"]
    wire = render(stored(**EVERYTHING), profile, omit=omit, exposure=SHARED)  # type: ignore[arg-type]
    document = orjson.loads(wire.body)
    assert not set(document) & set(omit)
    assert "correlation_id" in document
    for header in ("stream-key", "causation-id", "traceparent", "channel"):
        assert header not in wire.headers
    assert wire.headers["correlation-id"] == "corr"


def test_omit_can_drop_internal_only_fields_from_the_internal_profile() -> None:
    document = body(stored(**EVERYTHING), "internal", omit=["tenant", "event_class"])
    assert "tenant" not in document
    assert "event_class" not in document
    assert document["priority"] == 5


def test_cloudevents_structured_mode() -> None:
    wire = render(stored(**EVERYTHING), "cloudevents", exposure=SHARED)
    event = orjson.loads(wire.body)
    CloudEvent.model_validate(event)
    assert wire.content_type == "application/cloudevents+json"
    assert {k: event[k] for k in ("specversion", "id", "source", "type", "time", "subject")} == {
        "specversion": "1.0",
        "id": MESSAGE_ID,
        "source": "shop",
        "type": "order_placed",
        "time": "2026-11-22T15:00:01.250000Z",
        "subject": "o-1",
    }
    assert event["datacontenttype"] == "application/json"
    assert event["data"] == orjson.loads(PAYLOAD)
    assert (event["correlationid"], event["causationid"]) == ("corr", "cause")
    assert event["traceparent"] == TRACEPARENT
    assert event["eventversion"] == 3
    assert event["region"] == "eu"  # an extension is a top-level attribute
    assert not {"tenant", "priority", "checksum", "payload", "extensions"} & set(event)


def test_cloudevents_leaves_out_absent_and_omitted_attributes() -> None:
    event = body(
        stored(**EVERYTHING), "cloudevents", omit=["stream", "extensions"], exposure=SHARED
    )
    CloudEvent.model_validate(event)
    assert "subject" not in event
    assert "region" not in event
    bare = body(stored(), "cloudevents")
    assert not {"subject", "correlationid", "causationid", "traceparent"} & set(bare)


def test_cloudevents_binary_mode_sends_the_data_as_body_and_attributes_as_headers() -> None:
    wire = render(stored(**EVERYTHING), "cloudevents", cloudevents_prefix="ce_", exposure=SHARED)
    assert orjson.loads(wire.body) == orjson.loads(PAYLOAD)
    assert wire.content_type == "application/json"
    assert wire.headers["ce_specversion"] == "1.0"
    assert wire.headers["ce_id"] == MESSAGE_ID
    assert wire.headers["ce_subject"] == "o-1"
    assert wire.headers["ce_eventversion"] == "3"
    assert wire.headers["ce_region"] == "eu"
    assert "ce_data" not in wire.headers


@pytest.mark.parametrize("name", ["Region", "region-code", "x" * 21, "", "id", "type", "subject"])
def test_cloudevents_rejects_extension_names_it_cannot_carry(name: str) -> None:
    with pytest.raises(EnvelopeError, match="not a valid CloudEvents attribute name"):
        render(stored(stream="o-1", extensions={name: "v"}), "cloudevents", exposure=SHARED)


@pytest.mark.parametrize("name", ["subject", "data"])
def test_cloudevents_rejects_reserved_names_even_when_the_event_lacks_them(name: str) -> None:
    with pytest.raises(EnvelopeError, match="not a valid CloudEvents attribute name"):
        render(stored(extensions={name: "v"}), "cloudevents", exposure=SHARED)


def test_headers_carry_the_identity_of_the_event() -> None:
    wire = render(stored(**EVERYTHING), "external", exposure=SHARED)
    assert wire.headers == {
        "channel": "web",
        "message-id": MESSAGE_ID,
        "event-type": "order_placed",
        "event-version": "3",
        "source": "shop",
        "stream-key": "o-1",
        "correlation-id": "corr",
        "causation-id": "cause",
        "traceparent": TRACEPARENT,
        "content-type": "application/json",
    }
    assert (wire.message_id, wire.event_type) == (MESSAGE_ID, "order_placed")
    assert (wire.stream_key, wire.correlation_id) == ("o-1", "corr")


def test_the_gap_before_a_message_is_spliced_after_the_sequence_and_named_in_a_header() -> None:
    raw = stored(**EVERYTHING)
    wire = render(raw, "internal", sequence=42, skipped=GAP)
    assert wire.body.endswith(
        b'"sequence":42,"skipped":["%s","%s"]}' % tuple(g.encode() for g in GAP)
    )
    assert orjson.loads(wire.body) == {**orjson.loads(raw), "sequence": 42, "skipped": list(GAP)}
    assert wire.headers["skipped-message-ids"] == ",".join(GAP)
    # Stored with nulls by an earlier version: parsed and dumped, to the same document.
    plain = stored(stream="o-1")
    legacy = orjson.dumps({**orjson.loads(plain), "priority": None})
    assert orjson.loads(render(legacy, "internal", sequence=42, skipped=GAP).body) == {
        **orjson.loads(plain),
        "sequence": 42,
        "skipped": list(GAP),
    }


@pytest.mark.parametrize(
    ("profile", "prefix", "omit"),
    [
        ("internal", None, ()),  # the stored document spliced
        ("internal", None, ("tenant",)),  # parsed and dumped
        ("external", None, ()),
        ("cloudevents", None, ()),
        ("cloudevents", "ce_", ()),
    ],
)
def test_a_long_gap_names_its_oldest_ids_and_counts_them_all(
    profile: Profile, prefix: str | None, omit: tuple[str, ...]
) -> None:
    """A flood of abandoned rows would name thousands of ids in one header, which RabbitMQ
    answers by closing the connection (frame_too_large past about 3,500): a message names
    the oldest MAX_SKIPPED_NAMED and says how many there were."""
    gap = [f"01890a5d-ac96-774b-bcce-{n:012d}" for n in range(5_000)]
    wire = render(
        stored(**EVERYTHING),
        profile,
        sequence=7,
        skipped=gap,
        omit=omit,
        cloudevents_prefix=prefix,
        exposure=SHARED,
    )
    assert wire.headers["skipped-message-ids"] == ",".join(gap[:MAX_SKIPPED_NAMED])
    assert wire.headers["skipped-count"] == "5000"
    assert len(wire.headers["skipped-message-ids"]) < 4_000
    body = orjson.loads(wire.body)
    if profile == "internal":
        assert body["skipped"] == gap[:MAX_SKIPPED_NAMED]
        assert body["skipped_count"] == 5_000
    else:
        assert b"skipped" not in wire.body


@pytest.mark.parametrize("length", [1, MAX_SKIPPED_NAMED])
def test_a_gap_named_whole_has_no_count(length: int) -> None:
    gap = [f"01890a5d-ac96-774b-bcce-{n:012d}" for n in range(length)]
    wire = render(stored(**EVERYTHING), "internal", sequence=7, skipped=gap)
    assert wire.headers["skipped-message-ids"].split(",") == gap
    assert "skipped-count" not in wire.headers
    assert "skipped_count" not in orjson.loads(wire.body)


def test_a_staged_header_named_as_the_count_is_dropped() -> None:
    raw = stored(headers={"skipped-count": "forged", "channel": "web"}, stream="o-1")
    assert "skipped-count" not in render(raw, "internal", sequence=1).headers
    assert "skipped-count" not in render(raw, "internal", sequence=1, skipped=GAP).headers


@pytest.mark.parametrize("profile", ["internal", "external", "cloudevents"])
def test_a_message_after_no_gap_has_neither_the_field_nor_the_header(profile: str) -> None:
    # A staged header of the marker's name is no gap marker: the router's own says it.
    raw = stored(headers={"skipped-message-ids": "forged", "channel": "web"}, stream="o-1")
    wire = render(raw, profile, sequence=1, exposure=SHARED)  # type: ignore[arg-type]
    assert "skipped-message-ids" not in wire.headers
    assert wire.headers["channel"] == "web"
    assert "skipped" not in orjson.loads(wire.body)


@pytest.mark.parametrize(
    ("profile", "prefix"), [("external", None), ("cloudevents", None), ("cloudevents", "ce_")]
)
def test_a_partner_learns_of_the_gap_from_the_header_alone(
    profile: Profile, prefix: str | None
) -> None:
    """Every profile carries the marker as the router's transport header; a partner's body
    never has it, whatever its allow-list (docs/partners.md)."""
    wire = render(
        stored(**EVERYTHING), profile, skipped=GAP, cloudevents_prefix=prefix, exposure=SHARED
    )
    assert wire.headers["skipped-message-ids"] == ",".join(GAP)
    assert b"skipped" not in wire.body
    assert not any("skipped" in name for name in wire.headers if name != "skipped-message-ids")
    with pytest.raises(ValueError, match="cannot expose"):
        Exposure(fields=frozenset({"skipped"}))


def test_omit_drops_the_gap_from_the_body_and_the_header() -> None:
    wire = render(stored(**EVERYTHING), "internal", sequence=1, skipped=GAP, omit=["skipped"])
    assert "skipped" not in orjson.loads(wire.body)
    assert "skipped-message-ids" not in wire.headers


def test_user_headers_cannot_override_the_reserved_ones() -> None:
    forged = {"message-id": "forged", "event-type": "forged", "content-type": "text/plain"}
    wire = render(stored(headers={**forged, "channel": "web"}, stream="o-1"), "internal")
    assert wire.headers["message-id"] == MESSAGE_ID
    assert wire.headers["event-type"] == "order_placed"
    assert wire.headers["content-type"] == "application/json"
    assert wire.headers["channel"] == "web"


@pytest.mark.parametrize(
    ("profile", "prefix"),
    [("internal", None), ("external", None), ("cloudevents", None), ("cloudevents", "ce-")],
)
def test_a_consumer_finds_the_message_id_in_the_body_or_the_headers(
    profile: Any, prefix: str | None
) -> None:
    wire = render(stored(**EVERYTHING), profile, cloudevents_prefix=prefix)
    assert message_id_of(wire.body, wire.headers) == MESSAGE_ID
    if prefix is None:
        assert message_id_of(wire.body) == MESSAGE_ID


@pytest.mark.parametrize("profile", ["internal", "external"])
def test_an_event_without_fields_keeps_its_empty_payload(profile: str) -> None:
    document = body(stored(payload=b"{}"), profile)
    assert document["payload"] == {}
    model = InternalEnvelope if profile == "internal" else ExternalEnvelope
    model.model_validate(document)


def test_a_damaged_stored_envelope_is_an_envelope_error() -> None:
    with pytest.raises(EnvelopeError, match="not valid JSON"):
        render(b"{not json", "internal")
    with pytest.raises(EnvelopeError, match="no 'id' or 'type'"):
        render(b'{"payload": {}}', "external")


def test_unserialisable_extensions_are_an_envelope_error() -> None:
    with pytest.raises(EnvelopeError, match="'order_placed': envelope is not JSON-serialisable"):
        stored(extensions={"when": object()})


def test_uuid7_is_version_7_rfc_4122_and_strictly_increasing() -> None:
    before = time.time_ns() // 1_000_000
    ids = [uuid7() for _ in range(10_000)]
    after = time.time_ns() // 1_000_000
    assert {i.version for i in ids} == {7}
    assert {i.variant for i in ids} == {uuid.RFC_4122}
    assert all(a < b for a, b in itertools.pairwise(ids))
    assert all(str(a) < str(b) for a, b in itertools.pairwise(ids))  # text sorts the same
    # The first 48 bits are Unix milliseconds; a burst may borrow a few from the future.
    assert before <= ids[0].int >> 80 <= after
    assert before <= ids[-1].int >> 80 <= after + 10


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX")
def test_a_forked_child_draws_random_bits_of_its_own() -> None:
    # The random bits come from a pool: a child must not go on with its parent's copy.
    uuid7()  # the pool is filled
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.write(write, uuid7().bytes)
        finally:
            os._exit(0)
    os.close(write)
    child = uuid.UUID(bytes=os.read(read, 16))
    os.close(read)
    os.waitpid(pid, 0)
    parent = uuid7()
    random_bits = (1 << 62) - 1
    assert child.int & random_bits != parent.int & random_bits


@pytest.mark.parametrize(
    ("profile", "exposure", "carried"),
    [
        ("internal", Exposure.NOTHING, 7),
        ("external", Exposure.NOTHING, None),
        ("external", Exposure(fields=frozenset({"priority"})), 7),
        ("cloudevents", Exposure.NOTHING, None),
    ],
)
def test_a_staged_priority_reaches_the_broker_only_where_the_body_carries_it(
    profile: Profile, exposure: Exposure, carried: int | None
) -> None:
    stored = make_internal_envelope(
        message_id=str(uuid7()),
        event_type="order_placed",
        version=1,
        time=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
        source="shop",
        payload_json=b"{}",
        priority=7,
    )

    wire = render(stored, profile, exposure=exposure)

    assert wire.priority == carried
    assert wire.time == "2026-01-02T03:04:05.000000Z"
