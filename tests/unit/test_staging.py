"""Turning events into outbox rows: targets, destinations, and rejections before anything is
written (``Stager.build_rows`` contacts no database and no broker)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict

from envelopes import InternalEnvelope
from router import Event, RouterConfig, StagingError
from router.write.staging import Row, Stager
from tests.conftest import make_config


class Placed(Event, type="orders.placed", published=True):
    order_id: str


class Reserved(Event, type="orders.reserved"):
    order_id: str


class Charged(Event, type="billing.charged", version=4, published=True, destination="money"):
    amount: int


class Opaque(Event, type="orders.opaque", published=True):
    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)
    thing: Any


TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

BROKERS: dict[str, Any] = {
    "events": {"type": "memory", "internal": True, "destination": "{service}.{event_type}"},
    "analytics": {"type": "memory", "destination": "a.{destination}.v{version}"},
    "billing": {"type": "memory", "events": {"include": ["billing.*"]}},
    "audit": {"type": "memory", "events": {"include": ["*"], "exclude": ["billing.*"]}},
}

NATS_EVENTS: dict[str, Any] = {
    "type": "nats",
    "internal": True,
    "destination": "shop.{event_type}",
    "stream": {"name": "SHOP", "subjects": ["shop.>"]},
}


def config(
    brokers: dict[str, Any] | None = None, *, database: Any = "sqlite:///x.db", limit: int = 2048
) -> RouterConfig:
    return make_config({"main": database}, brokers or BROKERS, outbox={"max_payload_bytes": limit})


def build(cfg: RouterConfig, *events: Event, **options: Any) -> list[Row]:
    return Stager(cfg).build_rows("main", events, **options)


def targets(cfg: RouterConfig, *events: Event) -> list[tuple[str, str]]:
    return [(row.target, row.destination) for row in build(cfg, *events)]


def test_an_internal_only_event_gets_one_row_for_the_internal_broker() -> None:
    assert targets(config(), Reserved(order_id="o")) == [("events", "shop.orders.reserved")]


def test_a_published_event_also_goes_to_every_external_broker_whose_filter_takes_it() -> None:
    # billing includes only billing.*; audit includes everything but billing.*
    assert targets(config(), Placed(order_id="o")) == [
        ("events", "shop.orders.placed"),
        ("analytics", "a.orders.placed.v1"),
        ("audit", "orders.placed"),
    ]
    assert targets(config(), Charged(amount=3)) == [
        ("events", "shop.billing.charged"),
        ("analytics", "a.money.v4"),
        ("billing", "money"),
    ]


def test_a_database_publishes_only_to_the_brokers_it_lists() -> None:
    cfg = config(database={"url": "sqlite:///x.db", "brokers": ["events", "billing"]})
    assert targets(cfg, Placed(order_id="o")) == [("events", "shop.orders.placed")]
    assert targets(cfg, Charged(amount=1)) == [
        ("events", "shop.billing.charged"),
        ("billing", "money"),
    ]


def test_one_event_is_one_id_and_one_envelope_on_all_its_rows() -> None:
    rows = build(
        config(),
        Placed(order_id="o-1"),
        Reserved(order_id="o-1"),
        stream_key="o-1",
        correlation_id="corr",
        headers={"channel": "web"},
    )
    assert [(r.target, r.event_type) for r in rows] == [
        ("events", "orders.placed"),
        ("analytics", "orders.placed"),
        ("audit", "orders.placed"),
        ("events", "orders.reserved"),
    ]
    placed, reserved = rows[:3], rows[3]
    assert len({r.message_id for r in placed}) == 1
    assert len({r.envelope for r in placed}) == 1
    assert reserved.message_id != placed[0].message_id
    assert {r.stream_key for r in rows} == {"o-1"}

    envelope = InternalEnvelope.model_validate_json(placed[0].envelope)
    assert envelope.id == placed[0].message_id
    assert (envelope.type, envelope.version, envelope.source) == ("orders.placed", 1, "shop")
    assert (envelope.stream, envelope.correlation_id) == ("o-1", "corr")
    assert envelope.headers == {"channel": "web"}
    assert envelope.payload == {"order_id": "o-1"}
    assert envelope.event_class == f"{__name__}.Placed"


@pytest.mark.parametrize(
    ("template", "destination"),
    [
        ("{event_type}", "billing.charged"),
        ("{destination}", "money"),
        ("{service}.{destination}", "shop.money"),
        ("v{version}/{event_type}", "v4/billing.charged"),
        ("fixed", "fixed"),
    ],
)
def test_destination_templates_are_filled_in_per_event(template: str, destination: str) -> None:
    cfg = config({"events": {"type": "memory", "internal": True, "destination": template}})
    assert targets(cfg, Charged(amount=1)) == [("events", destination)]


def test_destination_defaults_to_the_event_type() -> None:
    cfg = config({"events": {"type": "memory", "internal": True}})
    assert targets(cfg, Placed(order_id="o"), Charged(amount=1)) == [
        ("events", "orders.placed"),
        ("events", "money"),
    ]


def test_an_event_no_broker_takes_is_rejected() -> None:
    only_billing = config({"partner": {"type": "memory", "events": {"include": ["billing.*"]}}})
    with pytest.raises(StagingError, match="'orders.placed' has no target: no broker"):
        build(only_billing, Placed(order_id="o"))
    with pytest.raises(StagingError, match="not published and this database has no internal"):
        build(only_billing, Reserved(order_id="o"))


def test_one_rejected_event_rejects_the_whole_call() -> None:
    only_billing = config({"partner": {"type": "memory", "events": {"include": ["billing.*"]}}})
    with pytest.raises(StagingError, match="'orders.placed' has no target"):
        build(only_billing, Charged(amount=1), Placed(order_id="o"))


def test_a_payload_that_cannot_be_serialised_is_rejected() -> None:
    with pytest.raises(StagingError, match="event 'orders.opaque' cannot be serialised"):
        build(config(), Opaque(thing=object()))


def test_an_envelope_over_max_payload_bytes_is_rejected_and_one_at_the_limit_is_not() -> None:
    # The envelope's size grows by one byte per character of order_id, and nothing else in
    # it changes size from one call to the next (ids and times have a fixed width).
    probe = len(build(config(), Placed(order_id=""))[0].envelope)
    fits = Placed(order_id="x" * (2048 - probe))
    assert len(build(config(), fits)[0].envelope) == 2048
    with pytest.raises(StagingError, match=r"is 2,049 bytes as an envelope; the limit .* 2,048"):
        build(config(), Placed(order_id="x" * (2049 - probe)))


def test_a_nats_subject_the_stream_does_not_capture_is_rejected() -> None:
    outside = {**NATS_EVENTS, "destination": "elsewhere.{event_type}"}
    with pytest.raises(StagingError, match="broker 'events'.*not captured by stream 'SHOP'"):
        build(config({"events": outside}), Reserved(order_id="o"))
    assert targets(config({"events": NATS_EVENTS}), Reserved(order_id="o")) == [
        ("events", "shop.orders.reserved")
    ]


def test_an_event_whose_destination_is_no_valid_nats_subject_is_rejected() -> None:
    class Spaced(Event, type="orders placed"):
        pass

    with pytest.raises(StagingError, match="'shop.orders placed' is not a valid NATS subject"):
        build(config({"events": NATS_EVENTS}), Spaced())


def test_an_extension_a_cloudevents_broker_cannot_carry_is_rejected() -> None:
    cfg = config(
        {
            "events": {"type": "memory", "internal": True},
            "partner": {"type": "memory", "envelope": "cloudevents"},
        }
    )
    with pytest.raises(StagingError, match="Region"):
        build(cfg, Placed(order_id="o"), extensions={"Region": "eu"})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"headers": {"attempt": 1}}, "header 'attempt': header names and values must be strings"),
        ({"headers": {1: "one"}}, "header 1: header names and values must be strings"),
        ({"stream_key": 7}, "stream_key must be a string, got int"),
        ({"correlation_id": 7}, "correlation_id must be a string, got int"),
        ({"causation_id": b"x"}, "causation_id must be a string, got bytes"),
    ],
)
def test_malformed_options_are_rejected(options: dict[str, Any], message: str) -> None:
    with pytest.raises(StagingError, match=message):
        build(config(), Reserved(order_id="o"), **options)


def test_only_events_can_be_staged() -> None:
    with pytest.raises(StagingError, match="takes router.Event instances"):
        Stager(config()).build_rows("main", [{"order_id": "o"}])  # type: ignore[list-item]


def test_stream_keys_give_each_event_its_own_stream_in_the_row_and_the_envelope() -> None:
    events = [Placed(order_id="a1"), Reserved(order_id="b1"), Reserved(order_id="none")]
    rows = build(config(), *events, stream_keys=["a", "b", None])
    assert [(r.event_type, r.stream_key) for r in rows] == [
        ("orders.placed", "a"),
        ("orders.placed", "a"),
        ("orders.placed", "a"),
        ("orders.reserved", "b"),
        ("orders.reserved", None),
    ]
    streams = [InternalEnvelope.model_validate_json(r.envelope).stream for r in rows]
    assert streams == ["a", "a", "a", "b", None]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"stream_key": "a", "stream_keys": ["a", "b"]},
            r"pass stream_key \(one key for every event\) or stream_keys \(one per event\), "
            "not both",
        ),
        ({"stream_keys": ["a"]}, "stream_keys has length 1 for 2 events; pass one key"),
        ({"stream_keys": ["a", "b", "c"]}, "stream_keys has length 3 for 2 events"),
        ({"stream_keys": "ab"}, "stream_keys must be a list with one key .* per event, got str"),
        ({"stream_keys": {"a", "b"}}, "stream_keys must be a list .* got set"),
        ({"stream_keys": ["a", 2]}, r"stream_keys\[1\] must be a string, got int"),
    ],
)
def test_malformed_stream_keys_are_rejected(options: dict[str, Any], message: str) -> None:
    with pytest.raises(StagingError, match=message):
        build(config(), Reserved(order_id="o"), Reserved(order_id="p"), **options)


class Measured(Event, type="orders.measured", published=True):
    reading: float = 0.0
    taken_at: datetime | None = None
    lines: list[Line] = []
    tags: dict[str, float] = {}


class Line(BaseModel):
    price: float


Measured.model_rebuild()

NAN_OR_NAIVE = [
    (Measured(reading=math.nan), "payload.reading: NaN is not valid JSON"),
    (Measured(reading=math.inf), "payload.reading: Infinity is not valid JSON"),
    (Measured(reading=-math.inf), "payload.reading: -Infinity is not valid JSON"),
    (Measured(lines=[Line(price=1), Line(price=math.nan)]), "payload.lines[1].price: NaN"),
    (Measured(tags={"eu": -math.inf}), "payload.tags['eu']: -Infinity is not valid JSON"),
    (
        Measured(taken_at=datetime(2026, 1, 2, 3, 4, 5)),
        "payload.taken_at: a datetime without a timezone is ambiguous; give it one, "
        "e.g. datetime.now(UTC)",
    ),
]


@pytest.mark.parametrize(("event", "message"), NAN_OR_NAIVE)
def test_a_payload_value_json_cannot_hold_is_refused_naming_its_path(
    event: Measured, message: str
) -> None:
    # pydantic would write NaN and infinities as null, and a naive datetime without a zone.
    with pytest.raises(StagingError) as refused:
        build(config(), event)
    assert str(refused.value).startswith("event 'orders.measured' cannot be serialised: ")
    assert message in str(refused.value)


class Reading(Event, type="meter.reading"):
    value: float


class Stamped(Event, type="meter.stamped"):
    at: datetime


class Plain(Event, type="meter.plain"):
    meter: str
    count: int
    ok: bool
    note: str | None = None


def test_a_float_or_datetime_field_is_checked_on_every_call_not_just_the_first() -> None:
    stager = Stager(config())
    for _ in range(2):  # what a first, good event taught must not wave later ones through
        stager.build_rows("main", [Reading(value=1.5)], stream_key="m-1")
        stager.build_rows("main", [Stamped(at=datetime(2026, 1, 2, tzinfo=UTC))])
    with pytest.raises(StagingError, match=re.escape("payload.value: NaN is not valid JSON")):
        stager.build_rows("main", [Reading(value=math.nan)], stream_key="m-1")
    with pytest.raises(StagingError, match="payload.at: a datetime without a timezone"):
        stager.build_rows("main", [Stamped(at=datetime(2026, 1, 2))], stream_key="m-1")


@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning")
def test_a_model_of_plain_fields_is_staged_and_its_values_are_still_checked() -> None:
    stager = Stager(config())
    rows = stager.build_rows("main", [Plain(meter="m", count=3, ok=True)], stream_key="m-1")
    payload = InternalEnvelope.model_validate_json(rows[0].envelope).payload
    assert payload == {"meter": "m", "count": 3, "ok": True, "note": None}
    # Annotations promise nothing: model_construct() stores any value, and the serialiser
    # would write this NaN as null (with a warning). The values are what is checked.
    naive: Any = datetime(2026, 1, 2)  # what the annotations rule out, on purpose
    built = Plain.model_construct(meter=math.nan, count=naive, ok=True)  # type: ignore[arg-type]
    with pytest.raises(StagingError, match=re.escape("payload.meter: NaN is not valid JSON")):
        stager.build_rows("main", [built], stream_key="m-1")
    built = Plain.model_construct(meter="m", count=naive, ok=True)
    with pytest.raises(StagingError, match="payload.count: a datetime without a timezone"):
        stager.build_rows("main", [built], stream_key="m-1")


def test_finite_floats_and_aware_datetimes_are_staged_as_given() -> None:
    event = Measured(reading=2.5, taken_at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC))
    payload = InternalEnvelope.model_validate_json(build(config(), event)[0].envelope).payload
    assert payload["reading"] == 2.5
    assert payload["taken_at"] == "2026-01-02T03:04:05Z"


@pytest.mark.parametrize(
    ("extensions", "message"),
    [
        ({"score": math.nan}, "extensions['score']: NaN is not valid JSON"),
        ({"at": [datetime(2026, 1, 1)]}, "extensions['at'][0]: a datetime without a timezone"),
    ],
)
def test_an_extension_value_json_cannot_hold_is_refused(
    extensions: dict[str, Any], message: str
) -> None:
    with pytest.raises(StagingError, match=re.escape(message)):
        build(config(), Reserved(order_id="o"), extensions=extensions)


NUL = "holds a NUL character (\\x00), which a database text column or a broker header cannot carry"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"stream_key": "o\x001"}, f"stream_key 'o\\x001' {NUL}"),
        ({"stream_keys": ["a", "\x00"]}, f"stream_keys[1] '\\x00' {NUL}"),
        ({"headers": {"a\x00": "v"}}, f"header 'a\\x00' {NUL}"),
        ({"headers": {"a": "v\x00"}}, f"header 'a' value 'v\\x00' {NUL}"),
        ({"correlation_id": "c\x00"}, f"correlation_id 'c\\x00' {NUL}"),
        ({"causation_id": "\x00"}, f"causation_id '\\x00' {NUL}"),
        ({"traceparent": "\x00"}, f"traceparent '\\x00' {NUL}"),
    ],
)
def test_a_nul_character_in_text_that_goes_into_a_column_or_header_is_refused(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(StagingError) as refused:
        build(config(), Reserved(order_id="o"), Reserved(order_id="p"), **options)
    assert str(refused.value) == message


NATS_NAME = (
    "a NATS header name takes only ASCII letters, digits and !#$%&'*+-.^_`|~ (no spaces, no ':')"
)


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("bad name", NATS_NAME),
        ("a:b", NATS_NAME),
        ("", NATS_NAME),
        ("é", NATS_NAME),
        ("Nats-Expected-Stream", "NATS header names starting with 'Nats-' are JetStream's own"),
    ],
)
def test_a_header_name_nats_cannot_carry_is_refused_naming_the_broker(
    name: str, reason: str
) -> None:
    with pytest.raises(StagingError) as refused:
        build(config({"events": NATS_EVENTS}), Reserved(order_id="o"), headers={name: "v"})
    assert str(refused.value) == f"header {name!r} cannot go to broker 'events' (nats): {reason}"


PARTNERS: dict[str, Any] = {
    "events": {"type": "memory", "internal": True},
    "cache": {
        "type": "redis",
        "expose": {"headers": ["*"]},
        "destination": "{destination}",
    },
    "queue": {
        "type": "rabbitmq",
        "expose": {"headers": ["*"]},
        "exchange": {"name": "events"},
    },
    "stream": {"type": "kafka", "expose": {"headers": ["*"]}},
}


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        (
            {"body": "x"},
            "header 'body' cannot go to broker 'cache' (redis): a plain Redis entry's 'body' "
            "field is the body, so no header may have that name",
        ),
        (
            {"h" * 129: "x"},
            f"header {'h' * 129!r} cannot go to broker 'queue' (rabbitmq): a RabbitMQ header "
            "name is at most 128 bytes (UTF-8)",
        ),
    ],
)
def test_a_header_name_a_partner_broker_cannot_carry_is_refused(
    headers: dict[str, str], message: str
) -> None:
    with pytest.raises(StagingError) as refused:
        build(config(PARTNERS), Placed(order_id="o"), headers=headers)
    assert str(refused.value) == message


def test_header_names_only_the_broker_that_receives_them_is_asked_about() -> None:
    # Kafka carries any name; the partners that cannot carry these names never receive them
    # (not exposed, left out, or the event is not theirs).
    assert build(config(PARTNERS), Placed(order_id="o"), headers={"h" * 128: "x", "a b": "x"})
    hidden = {
        "events": NATS_EVENTS,
        "cache": {"type": "redis"},
        "queue": {"type": "rabbitmq", "exchange": {"name": "e"}, "omit": ["headers"]},
    }
    assert build(config(hidden), Placed(order_id="o"), headers={"body": "x", "h" * 200: "x"})
    assert build(config(PARTNERS), Reserved(order_id="o"), headers={"body": "x"})


def test_mysql_locks_one_key_in_its_insert_and_many_keys_by_sorted_slots_first() -> None:
    from router.write.mysql import mysql_statements, slot_of

    def row(key: str | None) -> Row:
        return Row("id", "events", "d", "e", key, "{}")

    [one] = mysql_statements([row("a"), row("a")])
    assert one.sql.startswith("INSERT INTO router_outbox") and "FOR UPDATE" in one.sql
    assert isinstance(one.params, tuple) and one.params[-1] == slot_of("a")
    assert one.repair is not None
    assert one.repair.params == (slot_of("a"),)
    lock, insert = mysql_statements([row("a"), row("b"), row(None), row("a")])
    assert lock.sql.startswith("INSERT INTO router_streams")
    assert lock.params == tuple(sorted({slot_of("a"), slot_of("b")}))
    # The envelope, ``{}``, goes in as a hex literal; the other columns as parameters.
    assert insert.sql.count("(%s, %s, %s, %s, %s, CONVERT(X'7b7d' USING utf8mb4))") == 4
    assert len(insert.params) == 4 * 5 and insert.repair is None
    [plain] = mysql_statements([row(None)])
    assert "router_streams" not in plain.sql
    assert all(0 <= int(slot_of(f"key-{i}")) < 1024 for i in range(1000))


def without_id_and_time(row: Row) -> Row:
    """``row`` with its message id and time, new on every call, made the same."""
    envelope = row.envelope.replace(row.message_id, "<id>")
    envelope = re.sub(r'"time":"[^"]*"', '"time":"<time>"', envelope)
    return dataclasses.replace(row, message_id="<id>", envelope=envelope)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"stream_key": "o-1"},
        {"stream_key": 'ordre "été" 注文'},
        {"stream_key": "o-1", "correlation_id": "c", "traceparent": TRACEPARENT},
        {"causation_id": "c", "correlation_id": "d"},
    ],
)
def test_the_common_call_makes_the_rows_the_fully_checked_call_makes(
    options: dict[str, Any],
) -> None:
    stager = Stager(config())
    events = [Placed(order_id="1"), Reserved(order_id="2"), Charged(amount=3)]
    common = stager.build_rows("main", events, **options)
    # tenant=None changes no envelope, but takes the call through every check.
    checked = stager.build_rows("main", events, tenant=None, **options)
    assert [without_id_and_time(r) for r in common] == [without_id_and_time(r) for r in checked]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"stream_key": 5}, "stream_key must be a string, got int"),
        ({"stream_key": "o", "correlation_id": 5}, "correlation_id must be a string, got int"),
        ({"correlation_id": "c\x00", "traceparent": "\x00"}, "correlation_id 'c\\x00' holds"),
        ({"traceparent": "\x00", "causation_id": "\x00"}, "causation_id '\\x00' holds"),
    ],
)
def test_the_common_call_refuses_what_the_fully_checked_call_refuses(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(StagingError, match=re.escape(message)):
        build(config(), Reserved(order_id="o"), **options)
    with pytest.raises(StagingError, match=re.escape(message)):
        build(config(), Reserved(order_id="o"), tenant=None, **options)


class Shipped(Event, type="orders.shipped", published=True):
    """Placed's targets, other destinations."""

    order_id: str


POSTGRES_CALLS: list[tuple[list[Event], dict[str, Any]]] = [
    ([Placed(order_id="1")], {"stream_key": "o-1"}),
    ([Placed(order_id="2")], {}),
    ([Reserved(order_id="3")], {"stream_key": "o-3"}),
    ([Charged(amount=4)], {"stream_key": "c'4"}),
    ([Placed(order_id="5"), Placed(order_id="6")], {"stream_key": "o-5"}),
    ([Placed(order_id="7"), Reserved(order_id="8")], {"stream_keys": ["o-7", "o-8"]}),
    ([Placed(order_id="9")], {"stream_key": "o-9"}),
    ([Shipped(order_id="9")], {"stream_key": "o-9"}),
]


def test_an_events_statement_is_the_same_made_afresh_or_from_the_last_with_its_targets() -> None:
    cfg = config(database="postgresql://u@127.0.0.1/x")
    warm = Stager(cfg)
    for events, options in POSTGRES_CALLS * 2:
        rows = warm.build_rows("main", events, **options)
        for simple, notify in itertools.product([False, True], repeat=2):
            afresh = Stager(cfg).statements("postgresql", rows, simple=simple, notify=notify)
            assert warm.statements("postgresql", rows, simple=simple, notify=notify) == afresh
