"""What is staged as internal never reaches a partner unless its ``expose:`` allows it: on
every broker, read with the broker's ordinary client (the harnesses' readers)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import orjson
import pytest

from brokers import OutgoingMessage, create_broker
from envelopes import make_internal_envelope, uuid7
from tests.contract.harnesses import Harness

SECRETS = (b"s3cr3t-header", b"4242-4242", b"acme-tenant", b"12.34-cost")
EXPOSE = {
    "headers": ["x-tenant"],
    "extensions": ["region"],
    "payload": {"order_placed": ["order_id", "total"]},
}


@pytest.mark.parametrize("profile", ["external", "cloudevents"])
async def test_only_what_expose_allows_arrives(harness: Harness, profile: str) -> None:
    settings = harness.settings(envelope=profile, expose=EXPOSE)
    destination = harness.destination()
    await harness.prepare(destination)
    stored = make_internal_envelope(
        message_id=str(uuid7()),
        event_type="order_placed",
        version=1,
        time=datetime.now(UTC),
        source="shop",
        payload_json=orjson.dumps(
            {"order_id": "o-1", "total": "9.90", "card": "4242-4242-4242-4242"}
        ),
        stream="o-1",
        headers={"x-internal-secret": "s3cr3t-header", "x-tenant": "t-1"},
        extensions={"region": "eu", "cost": "12.34-cost"},
        tenant="acme-tenant",
    )
    wire = settings.render(stored, sequence=1)  # what the processor sends this broker
    broker = create_broker("partner", settings)
    try:
        [result] = await broker.publish([OutgoingMessage(destination, wire)])
    finally:
        await broker.close()
    assert result.ok, result.error

    [got] = await harness.read_as_a_partner(destination, stream_key="o-1")

    everything = got.body + repr((got.headers, got.properties)).encode()
    assert [secret for secret in SECRETS if secret in everything] == []
    assert "x-internal-secret" not in got.headers
    assert got.headers["x-tenant"] == "t-1"
    body = json.loads(got.body)
    if profile == "external":
        assert (body["payload"], body["extensions"]) == (
            {"order_id": "o-1", "total": "9.90"},
            {"region": "eu"},
        )
        assert "tenant" not in body and "headers" not in body
    else:
        assert (body["data"], body["region"]) == ({"order_id": "o-1", "total": "9.90"}, "eu")
        assert "cost" not in body
