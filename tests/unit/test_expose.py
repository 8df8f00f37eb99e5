"""What a partner receives: an allow-list per broker (``expose``), default deny.

Each delivery test parses a config as a user writes it, delivers stored envelopes through the
processor's ``Delivery`` to an in-memory broker, and looks at what arrived there.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest

from brokers import MemoryBroker
from envelopes import (
    EXPOSABLE_FIELDS,
    Exposure,
    WireMessage,
    make_internal_envelope,
    render,
    uuid7,
)
from router import ConfigError, load_config, parse_config
from router.config import CircuitSettings, RetrySettings
from router.relay.circuit import Circuit
from router.relay.delivery import Delivery
from router.relay.link import BrokerLink
from router.relay.stats import ProcessorStats
from router.relay.store import ClaimedRow

PLACED = "orders.order_placed"
SHIPPED = "orders.order_shipped"
STAGED_HEADERS = {"X-Tenant": "t", "x-trace-id": "tr-1", "x-internal-secret": "s"}
EXTENSIONS = {"region": "eu", "cost": "1"}
# The transport headers the router sets itself: every partner gets them, whatever it exposes.
ROUTER_HEADERS = {
    "message-id",
    "event-type",
    "event-version",
    "source",
    "stream-key",
    "correlation-id",
    "causation-id",
    "traceparent",
    "content-type",
}
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

CONFIG = """
databases: {main: "sqlite:///x.db"}
brokers:
  events: {type: memory, internal: true}
  billing:
    type: memory
%s
"""
# The three shapes a partner may take.
PARTNERS = {
    "external": "    envelope: external\n",
    "structured": "    envelope: cloudevents\n",
    "binary": "    envelope: cloudevents\n    cloudevents_mode: binary\n",
}


def stored(event_type: str = PLACED, **payload: Any) -> bytes:
    """A stored envelope carrying every kind of metadata, staged headers and extensions."""
    return make_internal_envelope(
        message_id=str(uuid7()),
        event_type=event_type,
        version=2,
        time=datetime(2026, 11, 22, 15, 0, 1, tzinfo=UTC),
        source="shop",
        payload_json=orjson.dumps(
            payload or {"order_id": "o-1", "total": "12.30", "email": "a@example.com"}
        ),
        event_class="shop.events.OrderPlaced",
        stream="o-1",
        correlation_id="corr",
        causation_id="cause",
        traceparent=TRACEPARENT,
        tenant="acme",
        priority=5,
        expected_version=4,
        headers=STAGED_HEADERS,
        extensions=EXTENSIONS,
    )


async def deliver(settings_yaml: str, *envelopes: bytes, broker: str = "billing") -> list[Any]:
    """Deliver ``envelopes`` to one broker of the config; what arrived, as (headers, body)."""
    config = parse_config(CONFIG % settings_yaml, env={})
    memory = MemoryBroker(broker)
    retry = RetrySettings()
    labels = {"database": "main", "target": broker}
    stats = ProcessorStats()
    link = BrokerLink(
        memory,
        config.brokers[broker],
        Circuit(CircuitSettings(), retry),
        stats=stats,
        labels=labels,
    )
    delivery = Delivery(
        target=broker,
        settings=config.brokers[broker],
        link=link,
        retry=retry,
        stats=stats,
        rand=lambda: 0.5,
        labels=labels,
    )
    rows = [
        ClaimedRow(n, f"m-{n}", "orders", envelope.decode(), attempts=1)
        for n, envelope in enumerate(envelopes, start=1)
    ]
    marks = await delivery.deliver(rows)
    assert marks.published == [row.seq for row in rows], marks
    return [_arrived(message.wire) for message in memory.messages]


def _arrived(wire: WireMessage) -> tuple[dict[str, str], dict[str, Any]]:
    return wire.headers, orjson.loads(wire.body)


def attributes(partner: str, headers: dict[str, str], body: dict[str, Any]) -> dict[str, Any]:
    """Where each partner shape carries the extensions: the external body's ``extensions``, a
    structured event's top level, or ``ce_`` headers in binary mode."""
    if partner == "external":
        extensions: dict[str, Any] = body.get("extensions", {})
        return extensions
    if partner == "binary":
        return {k.removeprefix("ce_"): v for k, v in headers.items() if k.startswith("ce_")}
    return body


def payload_of(partner: str, body: dict[str, Any]) -> dict[str, Any]:
    """The payload as each partner shape carries it."""
    payload: dict[str, Any] = {"external": body.get("payload"), "structured": body.get("data")}.get(
        partner, body
    )
    return payload


@pytest.mark.parametrize("partner", PARTNERS)
async def test_a_partner_gets_no_staged_header_extension_or_internal_field_by_default(
    partner: str,
) -> None:
    [(headers, body)] = await deliver(PARTNERS[partner], stored())

    assert set(headers) >= ROUTER_HEADERS
    assert not {name.lower() for name in STAGED_HEADERS} & {name.lower() for name in headers}
    assert not set(EXTENSIONS) & set(attributes(partner, headers, body))
    for field in ("tenant", "priority", "expected_version", "checksum", "headers"):
        assert field not in body
        assert f"ce_{field}" not in headers
    assert payload_of(partner, body) == {
        "order_id": "o-1",
        "total": "12.30",
        "email": "a@example.com",
    }


async def test_the_internal_broker_still_gets_everything() -> None:
    [(headers, body)] = await deliver(PARTNERS["external"], stored(), broker="events")

    assert {k: headers[k] for k in STAGED_HEADERS} == STAGED_HEADERS
    assert body["headers"] == STAGED_HEADERS and body["extensions"] == EXTENSIONS
    assert (body["tenant"], body["priority"], body["event_class"]) == (
        "acme",
        5,
        "shop.events.OrderPlaced",
    )
    assert set(body["payload"]) == {"order_id", "total", "email"}


@pytest.mark.parametrize("partner", PARTNERS)
async def test_globs_pick_staged_headers_and_extensions_by_name_in_any_case(partner: str) -> None:
    expose = '    expose: {headers: ["x-tenant", "X-TRACE-*"], extensions: ["REG*"]}\n'

    [(headers, body)] = await deliver(PARTNERS[partner] + expose, stored())

    assert (headers["X-Tenant"], headers["x-trace-id"]) == ("t", "tr-1")
    assert "x-internal-secret" not in headers
    extensions = attributes(partner, headers, body)
    assert extensions["region"] == "eu"
    assert "cost" not in extensions


async def test_fields_add_internal_only_fields_to_the_external_body_before_the_payload() -> None:
    expose = "    expose: {fields: [priority, tenant]}\n"

    [(_, body)] = await deliver(PARTNERS["external"] + expose, stored())

    assert (body["tenant"], body["priority"]) == ("acme", 5)
    assert list(body)[-3:] == ["priority", "tenant", "payload"]
    assert not {"expected_version", "checksum", "event_class", "headers"} & set(body)


@pytest.mark.parametrize("partner", PARTNERS)
async def test_a_payload_projection_hides_fields_of_its_event_type_only(partner: str) -> None:
    expose = f"    expose: {{payload: {{{PLACED}: [order_id, total]}}}}\n"
    shipped = stored(SHIPPED, order_id="o-1", carrier="dhl", email="a@example.com")

    [(_, placed), (_, other)] = await deliver(PARTNERS[partner] + expose, stored(), shipped)

    assert payload_of(partner, placed) == {"order_id": "o-1", "total": "12.30"}
    assert payload_of(partner, other) == {
        "order_id": "o-1",
        "carrier": "dhl",
        "email": "a@example.com",
    }


@pytest.mark.parametrize("partner", PARTNERS)
async def test_omit_still_applies_after_expose(partner: str) -> None:
    expose = "    expose: {headers: ['*'], extensions: ['*']}\n    omit: [headers, extensions]\n"

    [(headers, body)] = await deliver(PARTNERS[partner] + expose, stored())

    assert "X-Tenant" not in headers
    assert "region" not in attributes(partner, headers, body)


async def test_omit_takes_back_an_exposed_field() -> None:
    expose = "    expose: {fields: [tenant, priority]}\n    omit: [tenant]\n"

    [(_, body)] = await deliver(PARTNERS["external"] + expose, stored())

    assert "tenant" not in body and body["priority"] == 5


def test_an_extension_a_partner_does_not_get_cannot_fail_its_rendering() -> None:
    """CloudEvents refuses 'Bad-Name' as an attribute; a partner that never gets it must not
    see its messages abandoned over it."""
    envelope = make_internal_envelope(
        message_id="m-1",
        event_type=PLACED,
        version=1,
        time=datetime(2026, 1, 1, tzinfo=UTC),
        source="shop",
        payload_json=b"{}",
        extensions={"Bad-Name": "x", "region": "eu"},
    )
    event = orjson.loads(
        render(envelope, "cloudevents", exposure=Exposure(extensions=("region",))).body
    )
    assert event["region"] == "eu" and "Bad-Name" not in event


def test_the_allow_list_is_compiled_once_per_broker() -> None:
    config = parse_config(CONFIG % '    expose: {headers: ["x-*"]}\n', env={})
    billing, events = config.brokers["billing"], config.brokers["events"]
    assert billing.exposure is billing.exposure
    assert billing.exposure.headers == ("x-*",)
    assert events.exposure is Exposure.EVERYTHING


def test_names_seen_are_remembered_in_a_bounded_memory() -> None:
    exposure = Exposure(headers=("x-keep-*",))
    envelope = orjson.loads(stored())
    for n in range(5000):  # names chosen by event writers: more than the memory holds
        envelope["headers"] = {f"x-keep-{n}": "1", f"y-{n}": "2", "X-Keep-Me": "3"}
        exposure.restrict(envelope)
        assert envelope["headers"] == {f"x-keep-{n}": "1", "X-Keep-Me": "3"}
    assert len(exposure._headers._seen) <= 1024


def test_exposable_fields_leave_out_the_routers_bookkeeping() -> None:
    assert sorted(EXPOSABLE_FIELDS) == [
        "asynchronous",
        "expected_version",
        "positions",
        "priority",
        "tenant",
    ]
    with pytest.raises(ValueError, match=r"cannot expose \['checksum'\]"):
        Exposure(fields=frozenset({"checksum", "tenant"}))


FIELDS = "'fields' takes asynchronous, expected_version, positions, priority, tenant"


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        (
            "    envelope: external\n    expose: {fields: [tenant, stream]}\n",
            f"brokers.billing.expose.fields[1]: 'stream' reaches partners anyway; {FIELDS}",
        ),
        (
            "    expose: {fields: [checksum]}\n",
            "brokers.billing.expose.fields[0]: 'checksum' is the router's bookkeeping and never "
            f"leaves; {FIELDS}",
        ),
        (
            "    expose: {fields: [headers]}\n",
            "brokers.billing.expose.fields[0]: staged headers are exposed by name, in "
            f"'expose.headers'; {FIELDS}",
        ),
        (
            "    expose: {fields: [tenent]}\n",
            f"brokers.billing.expose.fields[0]: unknown field 'tenent'; {FIELDS}",
        ),
        (
            f"    expose: {{payload: {{{PLACED}: []}}}}\n",
            f"brokers.billing.expose.payload.{PLACED}: an empty list would send this event type "
            "without a payload; list the fields to keep, leave the type out to send its whole "
            "payload, or keep it from this broker with 'events.exclude'",
        ),
        (
            f"    expose: {{payload: {{{PLACED}: [customer.email]}}}}\n",
            f"brokers.billing.expose.payload.{PLACED}[0]: 'customer.email': only top-level "
            "payload fields can be kept (a kept field keeps all of its contents)",
        ),
        (
            "    expose: {headers: ['']}\n",
            "brokers.billing.expose.headers[0]: an empty pattern matches no name",
        ),
        (
            "    expose: {header: [x-tenant]}\n",
            "brokers.billing.expose.header: unknown key (check the spelling; see "
            "docs/reference/configuration.md)",
        ),
        (
            "    envelope: cloudevents\n    expose: {fields: [tenant]}\n",
            "brokers.billing.expose: 'fields' adds internal-only fields to the external body, "
            "and a cloudevents envelope has none; stage what this partner needs as an "
            "extension instead",
        ),
        (
            "    envelope: internal\n    expose: {headers: [x-tenant]}\n",
            "brokers.billing.expose: envelope: internal sends everything; 'expose' is for the "
            "external and cloudevents envelopes",
        ),
    ],
)
def test_a_wrong_allow_list_is_a_config_error_naming_its_key(settings: str, problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(CONFIG % settings, env={})
    assert str(caught.value) == f"config.yaml: 1 problem:\n  - {problem}"


def test_expose_on_the_internal_broker_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(
        'databases: {main: "sqlite:///x.db"}\n'
        "brokers:\n"
        "  events: {type: memory, internal: true, expose: {headers: [x-tenant]}}\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path, env={})
    assert str(caught.value) == (
        f"{path}: 1 problem:\n"
        "  - brokers.events.expose: the internal broker gets everything; 'expose' is for partners"
    )
