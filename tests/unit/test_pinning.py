"""Downcasters and per-partner version pinning, without a database or a broker."""

from __future__ import annotations

from datetime import UTC, datetime

import orjson
import pytest

from envelopes import ConfigError, DowncastError, StagingError, make_internal_envelope
from router import Event, parse_config
from router.write.events import downcast, downcast_path
from router.write.pinning import Pinning, Received, check_pin, check_pins
from router.write.staging import Stager
from tests.conftest import make_config


class ShippedV1(Event, type="test.pin.shipped", version=1, published=True):
    order_id: str


class ShippedV2(Event, type="test.pin.shipped", version=2, published=True):
    order_id: str
    carrier: str


class ShippedV3(Event, type="test.pin.shipped", version=3, published=True):
    order_id: str
    carrier: str
    parcels: int


@ShippedV3.downcaster(to=2)
def _v3_to_v2(event: ShippedV3) -> ShippedV2:
    return ShippedV2(order_id=event.order_id, carrier=event.carrier)


@ShippedV2.downcaster(to=1)
def _v2_to_v1(event: ShippedV2) -> ShippedV1:
    if event.carrier == "broken":
        raise ValueError("carrier 'broken' has no v1 form")
    return ShippedV1(order_id=event.order_id)


class LonelyV1(Event, type="test.pin.lonely", version=1, published=True):
    order_id: str


class LonelyV2(Event, type="test.pin.lonely", version=2, published=True):
    order_id: str


def stored(event: Event) -> str:
    spec = type(event).__event__
    return make_internal_envelope(
        message_id="0190-aaaa",
        event_type=spec.type,
        version=spec.version,
        time=datetime(2026, 1, 1, tzinfo=UTC),
        source="shop",
        payload_json=event.model_dump_json().encode(),
        event_class=spec.class_path,
    ).decode()


def test_downcasters_chain_to_the_pinned_version() -> None:
    assert downcast_path("test.pin.shipped", 3, 1) == [2, 1]
    assert downcast_path("test.pin.shipped", 3, 3) == []
    assert downcast_path("test.pin.lonely", 2, 1) is None

    older = downcast(ShippedV3(order_id="o-1", carrier="ups", parcels=2), 1)

    assert older == ShippedV1(order_id="o-1")


def test_a_downcaster_must_point_below_its_class() -> None:
    with pytest.raises(TypeError, match=r"'to' must be a version below 2"):
        ShippedV2.downcaster(to=2)


def test_a_pinned_partner_gets_the_envelope_at_its_version_and_others_pass_through() -> None:
    pinning = Pinning({"test.pin.shipped": 1})
    current = stored(ShippedV3(order_id="o-1", carrier="ups", parcels=2))

    document = orjson.loads(pinning(current))

    assert (document["version"], document["payload"]) == (1, {"order_id": "o-1"})
    assert document["event_class"].endswith("ShippedV1")
    other = stored(LonelyV2(order_id="o-2"))
    assert pinning(other) is other


def test_a_downcaster_that_raises_fails_the_call_with_its_message() -> None:
    pinning = Pinning({"test.pin.shipped": 1})

    with pytest.raises(DowncastError, match=r"^carrier 'broken' has no v1 form$") as failed:
        pinning(stored(ShippedV2(order_id="o-1", carrier="broken")))
    assert isinstance(failed.value.__cause__, ValueError)


def test_what_a_target_receives_is_downcast_for_its_pins_then_rendered() -> None:
    config = make_config(
        {"main": "sqlite:///:memory:"},
        {
            "events": {"type": "memory", "internal": True},
            "billing": {"type": "memory", "versions": {"test.pin.shipped": 1}},
        },
    )
    current = stored(ShippedV3(order_id="o-1", carrier="ups", parcels=2))

    internal = Received(config.brokers["events"])(current, sequence=7)
    billing = Received(config.brokers["billing"])(current, sequence=7)

    assert internal == config.brokers["events"].render(current, sequence=7)
    assert billing.headers["event-version"] == "1"
    assert orjson.loads(billing.body)["payload"] == {"order_id": "o-1"}


def test_stage_time_refuses_a_pin_without_a_path_and_an_upcast() -> None:
    check_pin(ShippedV3.__event__, "partner", 1)
    with pytest.raises(StagingError) as no_path:
        check_pin(LonelyV2.__event__, "partner", 1)
    assert str(no_path.value) == (
        "event 'test.pin.lonely' version 2 cannot go to broker 'partner', pinned to version 1: "
        "declare a downcaster (@LonelyV2.downcaster(to=1))"
    )
    with pytest.raises(StagingError, match="pinned to version 3: events are downcast"):
        check_pin(ShippedV2.__event__, "partner", 3)


def test_start_up_refuses_a_pin_to_an_undeclared_version_or_without_a_path() -> None:
    check_pins({"partner": {"test.pin.shipped": 1}})
    with pytest.raises(ConfigError, match=r"^brokers.partner.versions.test.pin.lonely: event"):
        check_pins({"partner": {"test.pin.lonely": 1}})
    with pytest.raises(ConfigError) as undeclared:
        check_pins({"partner": {"test.pin.shipped": 7}})
    assert str(undeclared.value) == (
        "brokers.partner.versions.test.pin.shipped: no class declares 'test.pin.shipped' "
        "version 7 (list its module under events:)"
    )


def test_pins_in_the_config_are_checked_where_they_are_written() -> None:
    with pytest.raises(ConfigError) as error:
        parse_config(
            "databases: {main: sqlite:///x.db}\n"
            "brokers:\n"
            "  events: {type: memory, internal: true, versions: {a: 1}}\n"
            "  partner: {type: memory, versions: {a: 0}}\n"
        )

    assert str(error.value) == (
        "config.yaml: 2 problems:\n"
        "  - brokers.events.versions: the internal broker gets every event as staged; "
        "pin partners only\n"
        "  - brokers.partner.versions: a: a version is a positive integer"
    )


def test_a_pinned_partner_is_routed_to_the_destination_of_its_version() -> None:
    config = make_config(
        {"main": "sqlite:///x.db"},
        {
            "events": {
                "type": "memory",
                "internal": True,
                "destination": "{event_type}.v{version}",
            },
            "partner": {
                "type": "memory",
                "destination": "p.{event_type}.v{version}",
                "versions": {"test.pin.shipped": 1},
            },
        },
    )

    rows = Stager(config).build_rows("main", [ShippedV3(order_id="o", carrier="c", parcels=1)])

    assert {row.target: row.destination for row in rows} == {
        "events": "test.pin.shipped.v3",
        "partner": "p.test.pin.shipped.v1",
    }
