"""Turning events into rows: targets, destinations, and rejections before anything is written."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from router import Event, RouterConfig, StagingError
from router.staging import Stager, StagingOptions
from tests.conftest import make_config


class Placed(Event, type="orders.placed", published=True):
    order_id: str


class Internal(Event, type="orders.reserved"):
    order_id: str


class Routed(Event, type="billing.charged", version=4, published=True, destination="money"):
    amount: int


class Opaque(Event, type="orders.opaque", published=True):
    model_config = {"arbitrary_types_allowed": True, "frozen": True}
    thing: Any


def config(**brokers: dict[str, Any]) -> RouterConfig:
    default: dict[str, Any] = {
        "events": {"type": "memory", "internal": True, "destination": "{service}.{event_type}"},
        "analytics": {"type": "memory", "destination": "a.{destination}.v{version}"},
        "billing": {"type": "memory", "events": {"include": ["billing.*"]}},
        "audit": {"type": "memory", "events": {"include": ["*"], "exclude": ["billing.*"]}},
    }
    return make_config(
        {"main": "sqlite:///x.db"}, brokers or default, outbox={"max_payload_bytes": 2048}
    )


def rows(cfg: RouterConfig, *events: Event, **options: Any) -> list[tuple[str, str]]:
    built = Stager(cfg).build_rows("main", events, StagingOptions(**options))
    return [(row.target, row.destination) for row in built]


def test_an_internal_only_event_goes_to_the_internal_broker_only() -> None:
    assert rows(config(), Internal(order_id="o")) == [("events", "shop.orders.reserved")]


def test_a_published_event_goes_to_every_external_broker_whose_filter_takes_it() -> None:
    assert rows(config(), Placed(order_id="o")) == [
        ("events", "shop.orders.placed"),
        ("analytics", "a.orders.placed.v1"),
        ("audit", "orders.placed"),
    ]
    assert rows(config(), Routed(amount=3)) == [
        ("events", "shop.billing.charged"),
        ("analytics", "a.money.v4"),
        ("billing", "money"),
    ]


def test_every_row_of_one_event_shares_its_id_and_envelope() -> None:
    built = Stager(config()).build_rows(
        "main",
        [Placed(order_id="o"), Internal(order_id="o")],
        StagingOptions(stream_key="o", headers={"k": "v"}),
    )
    placed = [r for r in built if r.event_type == "orders.placed"]
    assert len({r.message_id for r in placed}) == 1
    assert len({r.envelope for r in placed}) == 1
    assert built[-1].message_id != placed[0].message_id
    assert {r.stream_key for r in built} == {"o"}
    assert orjson.loads(placed[0].envelope)["headers"] == {"k": "v"}


def test_an_event_no_broker_takes_is_rejected() -> None:
    only_billing = config(partner={"type": "memory", "events": {"include": ["billing.*"]}})
    with pytest.raises(StagingError, match="'orders.placed' has no target"):
        rows(only_billing, Placed(order_id="o"))
    with pytest.raises(StagingError, match="not published and this database has no internal"):
        rows(only_billing, Internal(order_id="o"))


def test_an_envelope_over_the_limit_is_rejected_with_its_size() -> None:
    with pytest.raises(StagingError, match=r"bytes as an envelope; the limit .* is 2,048"):
        rows(config(), Placed(order_id="x" * 3000))


def test_a_payload_that_cannot_be_serialised_is_rejected() -> None:
    with pytest.raises(StagingError, match="'orders.opaque' cannot be serialised"):
        rows(config(), Opaque(thing=object()))


def test_a_nats_subject_no_stream_captures_is_rejected() -> None:
    nats = config(
        events={
            "type": "nats",
            "internal": True,
            "destination": "elsewhere.{event_type}",
            "stream": {"name": "SHOP", "subjects": ["shop.>"]},
        }
    )
    with pytest.raises(StagingError, match="not captured by stream 'SHOP'"):
        rows(nats, Internal(order_id="o"))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"headers": {"n": 1}}, "header names and values must be strings"),
        ({"stream_key": 7}, "stream_key must be a string"),
        ({"correlation_id": 7}, "correlation_id must be a string"),
    ],
)
def test_malformed_options_are_rejected(options: dict[str, Any], message: str) -> None:
    with pytest.raises(StagingError, match=message):
        rows(config(), Internal(order_id="o"), **options)


def test_only_events_can_be_staged() -> None:
    with pytest.raises(StagingError, match="takes router.Event instances"):
        Stager(config()).build_rows("main", [{"order_id": "o"}], StagingOptions())  # type: ignore[list-item]
