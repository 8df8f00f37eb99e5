"""A partner's payload projection (``expose.payload``) per event version: a type's list applies
to every version the partner receives unless a version has its own (``TYPE@VERSION``), and a
field one of them lacks is refused, naming the YAML path, instead of dropped without a word.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from pathlib import Path

import orjson
import pytest

from envelopes import ConfigError, make_internal_envelope, uuid7
from router import parse_config
from router.write.catalog import EventCatalog, check_partners, load_catalog

TWO_VERSIONS = """
from router import Event

class OrderPlacedV1(Event, type="projected.order_placed", version=1, published=True):
    order_id: str
    total: str

class OrderPlaced(Event, type="projected.order_placed", version=2, published=True):
    order_id: str
    total_cents: int
    currency: str

@OrderPlaced.downcaster(to=1)
def _(event: OrderPlaced) -> OrderPlacedV1:
    return OrderPlacedV1(order_id=event.order_id, total=f"{event.total_cents / 100:.2f}")
"""
CONFIG = """
databases: {main: "sqlite:///x.db"}
brokers:
  events: {type: memory, internal: true}
  billing:
    type: memory
%s
"""
WHERE = "brokers.billing.expose.payload.projected.order_placed"


@pytest.fixture(scope="module")
def catalog(tmp_path_factory: pytest.TempPathFactory) -> EventCatalog:
    folder: Path = tmp_path_factory.mktemp("events")
    name = f"events_{uuid.uuid4().hex[:8]}"
    (folder / f"{name}.py").write_text(TWO_VERSIONS)
    return load_catalog([name], folder)


def checked(catalog: EventCatalog, lines: str) -> None:
    check_partners(parse_config(CONFIG % lines), catalog)


def refusal(catalog: EventCatalog, lines: str) -> str:
    with pytest.raises(ConfigError) as error:
        checked(catalog, lines)
    return str(error.value)


def test_a_list_naming_fields_one_published_version_lacks_is_refused(
    catalog: EventCatalog,
) -> None:
    # v1's fields: v2 has no total. (A list of the newest version's fields, which releases
    # before TYPE@VERSION accepted, is accepted with a warning: test_config_upgrades.py.)
    oldest = "    expose: {payload: {projected.order_placed: [order_id, total]}}"

    assert refusal(catalog, oldest) == (
        f"{WHERE}: version 2 has no field 'total'; its fields: order_id, total_cents, "
        "currency; version 2 is still published: give it its own projection "
        "(projected.order_placed@2: [...])"
    )


def test_fields_every_version_has_project_every_version(catalog: EventCatalog) -> None:
    checked(catalog, "    expose: {payload: {projected.order_placed: [order_id]}}")


def test_a_version_of_its_own_takes_the_place_of_the_types_list(catalog: EventCatalog) -> None:
    lines = (
        "    expose:\n"
        "      payload:\n"
        "        projected.order_placed: [order_id, total_cents, currency]\n"
        "        projected.order_placed@1: [order_id, total]\n"
    )
    checked(catalog, lines)
    exposure = parse_config(CONFIG % lines).brokers["billing"].exposure

    assert exposure.kept("projected.order_placed", 1) == frozenset({"order_id", "total"})
    assert exposure.kept("projected.order_placed", 2) == frozenset(
        {"order_id", "total_cents", "currency"}
    )
    assert exposure.kept("projected.order_shipped", 1) is None


def test_each_version_is_rendered_with_its_own_projection(catalog: EventCatalog) -> None:
    lines = (
        "    expose:\n"
        "      payload:\n"
        "        projected.order_placed: [order_id, total_cents]\n"
        "        projected.order_placed@1: [total]\n"
    )
    billing = parse_config(CONFIG % lines).brokers["billing"]

    def sent(version: int, payload: dict[str, object]) -> object:
        stored = make_internal_envelope(
            message_id=str(uuid7()),
            event_type="projected.order_placed",
            version=version,
            time=datetime(2026, 11, 22, tzinfo=UTC),
            source="shop",
            payload_json=orjson.dumps(payload),
        )
        return orjson.loads(billing.render(stored, sequence=1).body)["payload"]

    assert sent(1, {"order_id": "o-1", "total": "1.00"}) == {"total": "1.00"}
    assert sent(2, {"order_id": "o-1", "total_cents": 100, "currency": "EUR"}) == {
        "order_id": "o-1",
        "total_cents": 100,
    }


def test_a_pinned_partner_projects_its_pinned_version_only(catalog: EventCatalog) -> None:
    pinned = "    versions: {projected.order_placed: 1}\n"

    checked(catalog, pinned + "    expose: {payload: {projected.order_placed: [order_id, total]}}")
    assert refusal(
        catalog, pinned + "    expose: {payload: {projected.order_placed@2: [order_id]}}"
    ) == (
        f"{WHERE}@2: this broker is pinned to version 1 (versions.projected.order_placed), so it "
        "never receives version 2"
    )


def test_a_version_of_its_own_must_be_declared(catalog: EventCatalog) -> None:
    assert refusal(catalog, "    expose: {payload: {projected.order_placed@3: [order_id]}}") == (
        f"{WHERE}@3: event type 'projected.order_placed' has no version 3; known versions: [1, 2]"
    )
    assert refusal(catalog, "    expose: {payload: {projected.order_placed@1: [total_cents]}}") == (
        f"{WHERE}@1: version 1 has no field 'total_cents'; its fields: order_id, total"
    )


@pytest.mark.parametrize(
    "key", ["projected.order_placed@", "projected.order_placed@v1", "@1", "x@0"]
)
def test_a_malformed_version_key_is_a_config_error(key: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_config(CONFIG % f"    expose: {{payload: {{'{key}': [order_id]}}}}")

    assert str(error.value) == (
        f"config.yaml: 1 problem:\n  - brokers.billing.expose.payload.{key}: {key!r}: name an "
        "event type, or one version of it as TYPE@VERSION (orders.order_placed@1)"
    )
