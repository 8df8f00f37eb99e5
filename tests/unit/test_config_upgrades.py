"""A config that worked with the previous release still loads after the upgrade: each form
this release replaced is accepted with a ``ConfigDeprecationWarning`` that names the YAML path
and what to write instead, and behaves as that replacement does."""

from __future__ import annotations

import uuid
import warnings
from datetime import UTC, datetime
from pathlib import Path

import orjson
import pytest

from envelopes import make_internal_envelope, uuid7
from router import ConfigDeprecationWarning, RouterConfig, parse_config
from router.write.catalog import EventCatalog, check_partners, load_catalog
from tests.unit.test_projections import CONFIG, TWO_VERSIONS

OPEN_AFTER = """
databases: {main: "sqlite:///x.db"}
brokers: {events: {type: memory, internal: true}}
outbox:
  circuit: {open_after: 30, probe_max_delay: 5}
"""
# The previous release applied a type's list to every version, checking it against the
# newest only: version 1, still published, lost its 'total' without a word.
OLD_PROJECTION = (
    "    expose: {payload: {projected.order_placed: [order_id, total_cents, currency]}}"
)
NEW_PROJECTION = (
    "    expose:\n"
    "      payload:\n"
    "        projected.order_placed: [order_id, total_cents, currency]\n"
    "        projected.order_placed@1: [order_id]\n"
)


@pytest.fixture(scope="module")
def catalog(tmp_path_factory: pytest.TempPathFactory) -> EventCatalog:
    """Versions 1 and 2 of projected.order_placed, both published."""
    folder: Path = tmp_path_factory.mktemp("events")
    name = f"events_{uuid.uuid4().hex[:8]}"
    (folder / f"{name}.py").write_text(TWO_VERSIONS)
    return load_catalog([name], folder)


def test_circuit_open_after_is_accepted_with_a_warning_and_ignored() -> None:
    with pytest.warns(ConfigDeprecationWarning) as caught:
        old = parse_config(OPEN_AFTER, source="app.yaml", env={})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = parse_config(OPEN_AFTER.replace("open_after: 30, ", ""), env={})

    assert [str(w.message) for w in caught] == [
        "app.yaml: outbox.circuit.open_after is ignored: a host's circuit now opens at the "
        "first publish its broker leaves unanswered; delete the key "
        "(outbox.circuit.probe_max_delay sets how soon a host claims again once its broker "
        "answers)"
    ]
    assert old.outbox.model_dump(exclude={"circuit": {"open_after"}}) == new.outbox.model_dump(
        exclude={"circuit": {"open_after"}}
    )


def test_a_projection_of_the_newest_version_only_is_accepted_with_its_replacement(
    catalog: EventCatalog,
) -> None:
    old = parse_config(CONFIG % OLD_PROJECTION)
    new = parse_config(CONFIG % NEW_PROJECTION)

    with pytest.warns(ConfigDeprecationWarning) as caught:
        check_partners(old, catalog)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_partners(new, catalog)

    assert [str(w.message) for w in caught] == [
        "brokers.billing.expose.payload.projected.order_placed: version 1 has no field "
        "'total_cents', 'currency', so its messages carry order_id only; "
        "to keep that, add under expose.payload: 'projected.order_placed@1: [order_id]' "
        "(or list the version 1 fields this partner should get); a later release refuses "
        "the list without it"
    ]
    payloads: list[tuple[int, dict[str, object]]] = [
        (1, {"order_id": "o-1", "total": "1.00"}),
        (2, {"order_id": "o-1", "total_cents": 100, "currency": "EUR"}),
    ]
    for version, payload in payloads:
        assert sent(old, version, payload) == sent(new, version, payload)
    assert sent(old, 1, {"order_id": "o-1", "total": "1.00"}) == {"order_id": "o-1"}


def sent(config: RouterConfig, version: int, payload: dict[str, object]) -> object:
    """The payload the billing partner receives of one version of the event."""
    stored = make_internal_envelope(
        message_id=str(uuid7()),
        event_type="projected.order_placed",
        version=version,
        time=datetime(2026, 11, 22, tzinfo=UTC),
        source="shop",
        payload_json=orjson.dumps(payload),
    )
    rendered = config.brokers["billing"].render(stored, sequence=1)
    return orjson.loads(rendered.body)["payload"]
