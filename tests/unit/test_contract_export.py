"""What ``router contract export`` tells a partner's validator about a payload's fields."""

from __future__ import annotations

from typing import Any

import jsonschema
from referencing import Registry
from referencing.jsonschema import DRAFT7

from router import Event, parse_config
from router.ops.contract import asyncapi_document, partner_messages
from router.write.catalog import EventCatalog

CONFIG = """
service: shop
databases: {main: "sqlite:///x.db"}
brokers:
  events: {type: memory, internal: true}
  billing: {type: memory, destination: "billing.{event_type}"}
"""


class Priced(Event, type="priced", version=1, published=True):
    """A price was set; two fields came later, each with a default."""

    sku: str
    x: int | None = None
    y: int = 5


def exported_payload() -> tuple[dict[str, Any], jsonschema.Draft7Validator]:
    """The exported payload schema of ``Priced`` to billing, and a validator of it (its
    references resolved in the document)."""
    config = parse_config(CONFIG, env={})
    catalog = EventCatalog(classes={"priced": {1: Priced}})
    document = asyncapi_document("shop", "1", partner_messages(config, catalog))
    pointer = "/components/messages/billing.priced.v1/payload/properties/payload"
    registry: Registry[Any] = Registry().with_resource(
        "urn:contract", DRAFT7.create_resource(document)
    )
    validator = jsonschema.Draft7Validator({"$ref": f"urn:contract#{pointer}"}, registry=registry)
    payload = document["components"]["messages"]["billing.priced.v1"]["payload"]
    return payload["properties"]["payload"], validator


def test_a_field_with_a_default_is_not_required_so_older_messages_stay_valid() -> None:
    schema, validator = exported_payload()

    assert schema["required"] == ["sku"]
    # A message sent before x and y were added lacks them: the partner must accept it.
    assert list(validator.iter_errors({"sku": "a-1"})) == []
    assert list(validator.iter_errors({"sku": "a-1", "x": None, "y": 5})) == []
    assert [e.message for e in validator.iter_errors({"x": 1})] == ["'sku' is a required property"]


GAPS = """
service: shop
databases: {main: "sqlite:///x.db"}
brokers:
  events: {type: memory, internal: true}
  billing: {type: memory}
  binary: {type: memory, envelope: cloudevents, cloudevents_mode: binary}
  mirror: {type: memory, envelope: internal}
"""


def test_every_partner_gets_the_gap_header_and_an_internal_profile_the_field() -> None:
    config = parse_config(GAPS, env={})
    catalog = EventCatalog(classes={"priced": {1: Priced}})
    messages = asyncapi_document("shop", "1", partner_messages(config, catalog))
    for partner in ("billing", "binary", "mirror"):
        message = messages["components"]["messages"][f"{partner}.priced.v1"]
        headers = message["headers"]
        assert headers["properties"]["skipped-message-ids"]["type"] == "string"
        assert "skipped-message-ids" not in headers["required"]  # only after a gap
        body = message["payload"].get("properties", {})
        assert ("skipped" in body) is (partner == "mirror"), partner
    mirror = messages["components"]["messages"]["mirror.priced.v1"]["payload"]
    assert mirror["properties"]["skipped"]["items"] == {"type": "string"}
    assert "skipped" not in mirror["required"]


ATOMIC = """
service: shop
databases: {main: "postgresql://app@db/shop"}
brokers:
  events: {type: memory, internal: true}
  ledger:
    type: nats
    atomic: true
    destination: "ledger.{event_type}"
    stream: {name: LEDGER, subjects: ["ledger.>"]}
  billing:
    type: nats
    destination: "billing.{event_type}"
    stream: {name: BILLING, subjects: ["billing.>"]}
"""


def test_an_atomic_partner_is_told_its_units_and_their_batch_headers() -> None:
    config = parse_config(ATOMIC, env={})
    catalog = EventCatalog(classes={"priced": {1: Priced}})
    document = asyncapi_document("shop", "1", partner_messages(config, catalog))
    servers = document["servers"]
    ledger = next(s for s in servers.values() if s["title"].startswith("ledger"))
    billing = next(s for s in servers.values() if s["title"].startswith("billing"))
    assert (
        "Atomic: the events one transaction commits for this partner arrive as one unit"
        in (ledger["description"])
    )
    assert "each transaction's messages in one batch (Nats-Batch-Id" in ledger["description"]
    assert "Atomic" not in billing["description"]
    messages = document["components"]["messages"]
    headers = messages["ledger.priced.v1"]["headers"]
    required = {"transaction-id", "transaction-size", "Nats-Batch-Id", "Nats-Batch-Sequence"}
    assert required <= set(headers["required"])
    assert "Nats-Batch-Commit" in headers["properties"]
    assert "Nats-Batch-Commit" not in headers["required"]  # the last member's only
    transaction = headers["properties"]["transaction-id"]["description"]
    assert "the first event of the transaction" in transaction
    assert "whole transactions" in headers["properties"]["Nats-Batch-Id"]["description"]
    billing = messages["billing.priced.v1"]["headers"]["properties"]
    assert not {"transaction-id", "Nats-Batch-Id"} & set(billing)
