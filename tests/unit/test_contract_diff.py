"""What ``router contract check`` calls breaking and what additive.

Each test locks the contract of one set of event classes and config, changes one thing, and
compares the lock of the result with the first one, through the same code the command runs
(``partner_messages`` -> ``lock_document`` -> ``compare``).
"""

from __future__ import annotations

import copy
from decimal import Decimal
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, Field

from router import Event, parse_config
from router.ops.contract import Change, compare, lock_document, partner_messages
from router.write.catalog import EventCatalog

CONFIG = """
service: shop
databases: {main: "sqlite:///x.db"}
brokers:
  events: {type: memory, internal: true}
  billing:
    type: memory
%s
"""


class Placed(Event, type="order_placed", version=1, published=True):
    """An order was placed."""

    order_id: str
    customer: str
    total: float
    quantity: int | str
    status: Literal["new", "paid"]
    note: str | None = None


def placed(**changes: Any) -> type[Event]:
    """``Placed`` with fields changed (a type), added (a type or ``(type, default)``) or
    removed (None), as another class of the same event type and version."""
    fields: dict[str, Any] = {
        name: (info.annotation, info) for name, info in Placed.model_fields.items()
    }
    for name, change in changes.items():
        if change is None:
            del fields[name]
        else:
            fields[name] = change if isinstance(change, tuple) else (change, ...)
    namespace: dict[str, Any] = {"__annotations__": {n: t for n, (t, _) in fields.items()}}
    namespace.update({n: d for n, (_, d) in fields.items() if d is not ...})
    namespace["__doc__"] = Placed.__doc__
    return type("Placed", (Event,), namespace, type="order_placed", version=1, published=True)


def lock(
    *classes: type[Event], partner: str = "", destination: str = "billing.{event_type}"
) -> dict[str, Any]:
    """The lock of these event classes, with ``partner`` added to the partner's config."""
    settings = f'    destination: "{destination}"\n{partner}'
    config = parse_config(CONFIG % settings, env={})
    catalog = EventCatalog()
    for cls in classes:
        spec = cls.__event__
        catalog.classes.setdefault(spec.type, {})[spec.version] = cls
    return lock_document(config.service, partner_messages(config, catalog))


def lines(changes: list[Change]) -> list[str]:
    return [change.line() for change in changes]


def breaking(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    return lines([c for c in compare(old, new) if c.breaking])


BEFORE = lock(Placed)


def test_the_same_contract_has_no_change_and_documentation_is_not_contract() -> None:
    documented = placed(customer=(str, Field(description="Who ordered.", examples=["ada"])))

    assert compare(BEFORE, lock(Placed)) == []
    assert compare(BEFORE, lock(documented)) == []


def test_a_renamed_field_is_one_breaking_change_naming_both_names() -> None:
    renamed = placed(customer=None, buyer=str)

    assert breaking(BEFORE, lock(renamed)) == [
        "breaking  billing  order_placed v1  payload.customer: renamed to payload.buyer "
        "(removed, and added with its schema)"
    ]
    assert all(c.breaking for c in compare(BEFORE, lock(renamed)))


def test_a_removed_field_is_breaking_even_if_it_was_nullable() -> None:
    assert breaking(BEFORE, lock(placed(note=None))) == [
        "breaking  billing  order_placed v1  payload.note: field removed"
    ]


def test_narrowing_a_type_is_breaking() -> None:
    assert breaking(BEFORE, lock(placed(total=int, quantity=int))) == [
        "breaking  billing  order_placed v1  payload.total: type narrowed: number -> integer",
        "breaking  billing  order_placed v1  payload.quantity: type narrowed: "
        "integer|string -> integer",
    ]


def test_widening_a_type_is_breaking_too() -> None:
    # A partner's reader written for integers would get 1.5.
    assert breaking(BEFORE, lock(placed(quantity=int | str | float))) == [
        "breaking  billing  order_placed v1  payload.quantity: type widened: "
        "integer|string -> integer|number|string"
    ]


def test_optional_made_required_and_back_are_both_breaking() -> None:
    required = lock(placed(note=str))

    assert breaking(BEFORE, required) == [
        "breaking  billing  order_placed v1  payload.note: optional made required "
        "(no longer nullable: null|string -> string)"
    ]
    assert breaking(required, BEFORE) == [
        "breaking  billing  order_placed v1  payload.note: required made optional "
        "(now nullable: string -> null|string)"
    ]


def test_an_enum_value_removed_is_breaking_and_so_is_one_added() -> None:
    assert breaking(BEFORE, lock(placed(status=Literal["new"]))) == [
        'breaking  billing  order_placed v1  payload.status: enum value removed: "paid"'
    ]
    # A reader that decodes the enum strictly rejects a value it does not know.
    assert breaking(BEFORE, lock(placed(status=Literal["new", "paid", "void"]))) == [
        'breaking  billing  order_placed v1  payload.status: enum value added: "void"'
    ]


class Address(BaseModel):
    city: str
    zip: str


class Colour(Enum):
    RED = "red"
    BLUE = "blue"


class Shipped(Event, type="order_shipped", version=1, published=True):
    """An order left the warehouse: nested models, a list, an Enum."""

    to: Address
    parcels: list[Address]
    colour: Colour


class ShortAddress(BaseModel):
    city: str


class Tint(Enum):
    RED = "red"


class ShippedChanged(Event, type="order_shipped", version=1, published=True):
    """The same event with a field gone from its nested model and an enum value less."""

    to: ShortAddress
    parcels: list[ShortAddress]
    colour: Tint


def test_changes_inside_nested_models_lists_and_enums_are_found_by_path() -> None:
    assert breaking(lock(Shipped), lock(ShippedChanged)) == [
        "breaking  billing  order_shipped v1  payload.to.zip: field removed",
        "breaking  billing  order_shipped v1  payload.parcels[].zip: field removed",
        'breaking  billing  order_shipped v1  payload.colour: enum value removed: "blue"',
    ]


class Node(BaseModel):
    name: str
    children: list[Node]


class Tree(Event, type="tree", version=1, published=True):
    """A recursive model."""

    root: Node


def test_a_recursive_model_compares_without_end() -> None:
    assert compare(lock(Tree), lock(Tree)) == []


def test_additive_changes_are_listed_and_do_not_break() -> None:
    class PlacedV2(Event, type="order_placed", version=2, published=True):
        order_id: str

    grown = lock(placed(gift=(bool | None, None), carrier=(str | None, None)), PlacedV2, Shipped)

    changes = compare(BEFORE, grown)

    assert lines(changes) == [
        "additive  billing  order_placed v1  payload.gift: new optional field",
        "additive  billing  order_placed v1  payload.carrier: new optional field",
        "additive  billing  order_placed v2  new version",
        "additive  billing  order_shipped v1  new event type",
    ]


def test_a_new_required_field_at_the_same_version_is_breaking() -> None:
    # Messages already sent at v1 (and stored rows replayed) lack it: a partner validating
    # with the new schema rejects them. Only optional fields may be added.
    grown = lock(placed(carrier=str))

    assert lines(compare(BEFORE, grown)) == [
        "breaking  billing  order_placed v1  payload.carrier: new required field: messages "
        "already sent at this version lack it (make it optional, or add it in a new version)"
    ]


def test_a_new_field_with_any_default_is_additive_and_one_without_breaks() -> None:
    # One rule with the export: a message without a field that has a default is valid, so
    # the messages already sent at v1 stay valid; a field without one makes them invalid.
    grown = lock(placed(gift=(int | None, None), boxes=(int, 5)))
    required_nullable = lock(placed(carrier=str | None))

    assert lines(compare(BEFORE, grown)) == [
        "additive  billing  order_placed v1  payload.gift: new optional field",
        "additive  billing  order_placed v1  payload.boxes: new optional field",
    ]
    assert lines(compare(BEFORE, required_nullable)) == [
        "breaking  billing  order_placed v1  payload.carrier: new required field: messages "
        "already sent at this version lack it (make it optional, or add it in a new version)"
    ]


def test_a_default_given_to_a_field_is_listed_and_a_default_taken_away_breaks() -> None:
    # The router still writes the field in every message; older ones may lack a field that
    # loses its default.
    defaulted = lock(placed(customer=(str, "anonymous")))

    assert lines(compare(BEFORE, defaulted)) == [
        "additive  billing  order_placed v1  payload.customer: now has a default: a message "
        "may lack it (the router still writes it)"
    ]
    assert breaking(defaulted, BEFORE) == [
        "breaking  billing  order_placed v1  payload.customer: optional made required"
    ]


def test_a_lock_from_before_defaults_were_optional_reads_without_a_false_break() -> None:
    # A lock of format 1 listed every field the router writes as required.
    old = copy.deepcopy(BEFORE)
    old["contract"] = "outbox-router partner contract lock, 1"
    payload = old["partners"]["billing"]["events"]["order_placed"]["1"]["payload"]
    payload["required"] = list(payload["properties"])

    assert compare(old, BEFORE) == []


def test_a_new_version_leaves_the_old_one_alone_but_dropping_the_old_one_breaks() -> None:
    class PlacedV2(Event, type="order_placed", version=2, published=True):
        order_id: int

    assert breaking(BEFORE, lock(Placed, PlacedV2)) == []
    assert breaking(BEFORE, lock(PlacedV2)) == [
        "breaking  billing  order_placed v1  no longer sent (the event class is gone or "
        "unpublished, or the broker's events filter leaves it out)"
    ]


def test_a_destination_change_is_breaking() -> None:
    moved = lock(Placed, destination="invoicing.{event_type}")

    assert breaking(BEFORE, moved) == [
        "breaking  billing  order_placed v1  destination: changed: "
        "billing.order_placed -> invoicing.order_placed"
    ]


def test_an_envelope_field_or_header_no_longer_sent_is_breaking() -> None:
    omitted = lock(Placed, partner="    omit: [correlation_id]")

    assert breaking(BEFORE, omitted) == [
        "breaking  billing  order_placed v1  envelope.correlation_id: field removed",
        "breaking  billing  order_placed v1  header correlation-id: no longer sent",
    ]


def test_what_expose_adds_is_additive_and_taking_it_back_breaks() -> None:
    exposed = lock(
        Placed, partner="    expose: {fields: [tenant], headers: [x-tenant], extensions: [region]}"
    )

    assert lines(compare(BEFORE, exposed)) == [
        "additive  billing  order_placed v1  envelope.tenant: new optional field",
        "additive  billing  order_placed v1  envelope.extensions: new optional field",
        "additive  billing  order_placed v1  envelope.extensions: extensions named 'region' "
        "now sent",
        "additive  billing  order_placed v1  headers: staged headers named 'x-tenant' now sent",
    ]
    assert breaking(exposed, BEFORE) == [
        "breaking  billing  order_placed v1  envelope.tenant: field removed",
        "breaking  billing  order_placed v1  envelope.extensions: field removed",
        "breaking  billing  order_placed v1  envelope.extensions: extensions named 'region' "
        "no longer sent",
        "breaking  billing  order_placed v1  headers: staged headers named 'x-tenant' no "
        "longer sent",
    ]


def test_a_payload_projection_that_hides_a_sent_field_breaks() -> None:
    projected = lock(
        Placed,
        partner="    expose: {payload: {order_placed: [order_id, customer, total, quantity, "
        "status]}}",
    )

    assert breaking(BEFORE, projected) == [
        "breaking  billing  order_placed v1  payload.note: field removed"
    ]


def test_a_new_envelope_profile_is_one_breaking_change_per_partner() -> None:
    cloudevents = lock(Placed, partner="    envelope: cloudevents")

    changes = breaking(BEFORE, cloudevents)

    assert changes == [
        "breaking  billing  every event  envelope: envelope changed: external -> cloudevents"
    ]


def test_a_partner_gone_breaks_each_event_it_had_and_a_new_one_is_additive() -> None:
    without = lock(Placed, partner="    events: {include: [nothing]}")

    assert lines(compare(BEFORE, without)) == [
        "breaking  billing  order_placed v1  no longer sent: nothing goes to this partner any more"
    ]
    assert lines(compare({"partners": {}}, BEFORE)) == [
        "additive  billing  order_placed v1  new partner"
    ]


def test_decimal_is_a_string_on_the_wire_and_a_field_with_a_default_is_not_required() -> None:
    class Priced(Event, type="priced", version=1, published=True):
        total: Decimal
        note: str | None = None

    payload = lock(Priced)["partners"]["billing"]["events"]["priced"]["1"]["payload"]

    assert payload["properties"]["total"]["type"] == "string"
    assert payload["required"] == ["total"]


class PinnedV1(Event, type="pinned_order", version=1, published=True):
    """The old shape, which a pinned partner keeps getting."""

    order_id: str


class PinnedV2(Event, type="pinned_order", version=2, published=True):
    """The new shape."""

    order_id: str
    total: int


@PinnedV2.downcaster(to=1)
def _to_v1(event: PinnedV2) -> PinnedV1:
    return PinnedV1(order_id=event.order_id)


def test_a_partner_pinned_to_a_version_has_that_version_in_its_contract_only() -> None:
    pin = "    versions: {pinned_order: 1}"

    before, after = lock(PinnedV1, partner=pin), lock(PinnedV1, PinnedV2, partner=pin)

    # Staging v2 reaches the pinned partner as v1 (downcast): nothing changes for it.
    assert compare(before, after) == []
    entry = after["partners"]["billing"]["events"]["pinned_order"]
    assert list(entry) == ["1"]
    assert list(entry["1"]["payload"]["properties"]) == ["order_id"]
    # Unpinned, the partner would get v2 as well.
    assert lines(compare(before, lock(PinnedV1, PinnedV2))) == [
        "additive  billing  pinned_order v2  new version"
    ]
    # Pinned to the newest, an older class (staging refuses it: no upcasts) is skipped.
    newest = lock(PinnedV1, PinnedV2, partner="    versions: {pinned_order: 2}")
    assert list(newest["partners"]["billing"]["events"]["pinned_order"]) == ["2"]


def test_a_new_service_name_changes_the_source_every_partner_filters_on() -> None:
    config_text = CONFIG.replace("service: shop", "service: shop2")
    config = parse_config(config_text % '    destination: "billing.{event_type}"\n', env={})
    catalog = EventCatalog(classes={"order_placed": {1: Placed}})
    renamed = lock_document(config.service, partner_messages(config, catalog))

    assert breaking(BEFORE, renamed) == [
        'breaking  billing  order_placed v1  envelope.source: value changed: "shop" -> "shop2"',
        "breaking  billing  order_placed v1  header source: value changed: shop -> shop2",
    ]


def bound(binding: dict[str, Any] | None) -> dict[str, Any]:
    """``BEFORE`` with the partner's binding set (None: a lock from before bindings)."""
    document = copy.deepcopy(BEFORE)
    partner = document["partners"]["billing"]
    partner.pop("binding", None)
    if binding is not None:
        partner["binding"] = binding
    return document


def test_moving_where_a_partner_consumes_is_breaking() -> None:
    exchange = {"name": "shop.events", "type": "topic", "durable": True}
    old = bound({"exchange": exchange, "vhost": "/"})
    new = bound({"exchange": {**exchange, "durable": False}, "vhost": "orders"})

    assert breaking(old, new) == [
        "breaking  billing  every event  binding.exchange.durable: changed: True -> False; a "
        "partner bound to the old one receives nothing more",
        "breaking  billing  every event  binding.vhost: changed: / -> orders; a partner bound "
        "to the old one receives nothing more",
    ]
    assert compare(old, old) == []


def test_a_lock_from_before_bindings_gets_them_as_additive_changes() -> None:
    assert lines(compare(bound(None), bound({"stream": "PARTNERS"}))) == [
        "additive  billing  every event  binding.stream: recorded: PARTNERS"
    ]


def test_a_lock_without_the_delivery_flags_is_read_and_they_are_recorded() -> None:
    exchange = {"name": "shop.events", "type": "topic", "durable": True}
    old = bound({"exchange": exchange, "vhost": "/"})
    new = bound({"exchange": exchange, "vhost": "/", "persistent": True, "mandatory": True})
    sturdier = bound({**new["partners"]["billing"]["binding"], "persistent": False})

    assert lines(compare(old, new)) == [
        "additive  billing  every event  binding.mandatory: recorded: True",
        "additive  billing  every event  binding.persistent: recorded: True",
    ]
    assert lines(compare(sturdier, new)) == [
        "additive  billing  every event  binding.persistent: changed: False -> True; messages "
        "are now stored on disk"
    ]
