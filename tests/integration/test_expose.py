"""A partner's allow-list over real PostgreSQL and NATS JetStream: what arrives is only what
its ``expose`` names; the internal broker still gets everything."""

from __future__ import annotations

import json
from decimal import Decimal

from router import Outbox
from tests.conftest import NatsStreams, make_config, nats_broker
from tests.integration.events import OrderPlaced
from tests.integration.test_delivery import serving, statuses


async def test_a_partner_receives_only_what_its_allow_list_names(
    pg_url: str, nats_streams: NatsStreams
) -> None:
    internal, partner = nats_streams.stream("int"), nats_streams.stream("partner")
    expose = {
        "headers": ["x-tenant"],
        "extensions": ["region"],
        "payload": {"order_placed": ["order_id"]},
    }
    config = make_config(
        {"main": pg_url},
        {
            "events": nats_broker(internal, internal=True),
            "billing": nats_broker(partner, envelope="external", expose=expose),
        },
    )
    outbox = Outbox(config)
    async with outbox.transaction() as tx:
        [message_id] = await tx.stage(
            OrderPlaced(order_id="o-1", total=Decimal("12.30"), note="gift"),
            stream_key="o-1",
            headers={"x-internal-secret": "s", "x-tenant": "t"},
            extensions={"region": "eu", "cost": "1"},
            tenant="acme",
        )
    await outbox.close()

    async with serving(config):
        [full] = await nats_streams.messages(internal[0], 1)
        [shared] = await nats_streams.messages(partner[0], 1)

    body = json.loads(shared.data)
    assert body["id"] == message_id
    assert shared.headers["x-tenant"] == "t"
    assert "x-internal-secret" not in shared.headers
    assert body["extensions"] == {"region": "eu"}
    assert body["payload"] == {"order_id": "o-1"}
    assert "tenant" not in body
    assert shared.headers["message-id"] == message_id  # the router's own headers go out
    assert shared.headers["stream-key"] == "o-1"

    everything = json.loads(full.data)
    assert (full.headers["x-internal-secret"], full.headers["x-tenant"]) == ("s", "t")
    assert everything["headers"] == {"x-internal-secret": "s", "x-tenant": "t"}
    assert everything["extensions"] == {"region": "eu", "cost": "1"}
    assert everything["payload"] == {"order_id": "o-1", "total": "12.30", "note": "gift"}
    assert everything["tenant"] == "acme"
    assert await statuses(pg_url) == {"events": ["published"], "billing": ["published"]}
