"""One database, five targets: NATS internal; Kafka, Service Bus, RabbitMQ and Redis external.
One committed event reaches each once; a partner whose peer stops only delays its own rows."""

from __future__ import annotations

import asyncio
import json
from decimal import Decimal

from envelopes import EXTERNAL_FIELDS, INTERNAL_ONLY_FIELDS
from router import Outbox
from tests.conftest import NatsStreams
from tests.contract.harnesses import Harness, ServiceBusHarness, contract_broker
from tests.integration.events import OrderPlaced
from tests.integration.five import config_for
from tests.integration.test_delivery import serving, statuses, wait_until


async def test_one_event_reaches_all_five_brokers_once_and_an_outage_stays_local(
    pg_url: str, partners: dict[str, Harness], nats_streams: NatsStreams
) -> None:
    config = config_for(pg_url, partners)
    destinations = {name: h.destination("order_placed") for name, h in partners.items()}
    for name, harness in partners.items():
        await harness.prepare(destinations[name])
    outbox = Outbox(config)
    servicebus = partners["servicebus"]
    assert isinstance(servicebus, ServiceBusHarness)

    async with serving(config, broker_factory=contract_broker) as supervisor:
        async with outbox.transaction() as tx:
            [first] = await tx.stage(
                OrderPlaced(order_id="o-1", total=Decimal("9.90")),
                stream_key="o-1",
                correlation_id="c-1",
            )
        arrived = {
            name: await h.arrived_once(destinations[name], 1) for name, h in partners.items()
        }

        # Service Bus goes away; the other four keep delivering everything meanwhile.
        # The peer runs on a thread of this process: stopping it waits for that thread, which
        # must not stall the event loop the router runs on (a stall of 2 s ends its batches).
        await asyncio.to_thread(servicebus.peer.stop)
        async with outbox.transaction() as tx:
            later = await tx.stage(
                *(OrderPlaced(order_id=f"o-{i}", total=Decimal(i)) for i in range(2, 7))
            )
        for name, harness in partners.items():
            if name != "servicebus":
                assert len(await harness.arrived_once(destinations[name], 6)) == 6, name

        # Its rows wait untried behind its open circuit (no attempt spent on the outage).
        circuit = supervisor.processor("main", "servicebus").circuit

        async def servicebus_waiting() -> bool:
            rows = (await statuses(pg_url))["servicebus"]
            return rows == ["published"] + ["pending"] * 5 and circuit.is_open

        try:
            await wait_until(servicebus_waiting, timeout=20)
        except AssertionError:
            raise AssertionError(await statuses(pg_url)) from None
        assert len(servicebus.peer.messages(destinations["servicebus"])) == 1

        await asyncio.to_thread(servicebus.peer.start)  # back: its rows go out
        everything = await servicebus.arrived_once(destinations["servicebus"], 6, timeout=30)
        await asyncio.sleep(0.5)
        final = await statuses(pg_url)
    await outbox.close()

    for name, messages in arrived.items():
        assert len(messages) == 1, name
        body = json.loads(messages[0].body)
        assert body["id"] == first
        if name == "events":
            assert "sequence" in body
            assert body["event_class"] == "tests.integration.events.OrderPlaced"
        else:
            assert set(body) <= set(EXTERNAL_FIELDS), name
            assert not set(body) & INTERNAL_ONLY_FIELDS, name
            assert body["correlation_id"] == "c-1"
    assert sorted(json.loads(m.body)["id"] for m in everything) == sorted([first, *later])
    assert all(set(rows) == {"published"} for rows in final.values()), final
