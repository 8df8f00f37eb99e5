"""Whatever broker and envelope profile an event came with, the consumer finds its id."""

from __future__ import annotations

import pytest

from brokers import create_broker
from envelopes import message_id_of
from tests.contract.harnesses import Harness
from tests.contract.test_contract import PROFILES, message, publish


@pytest.mark.parametrize("profile", PROFILES)
async def test_every_broker_and_profile_yields_the_events_message_id(
    harness: Harness, profile: dict[str, str]
) -> None:
    settings = harness.settings(**profile)
    destination = harness.destination("identify")
    await harness.prepare(destination)
    sent = [message(settings, destination, n, stream=None) for n in range(2)]
    assert all(r.ok for r in await publish(create_broker("partner", settings), sent))
    arrived = await harness.arrived(destination, 2)
    found = sorted(message_id_of(a.body, a.headers, native_id=a.native_id) or "" for a in arrived)
    assert found == sorted(m.wire.message_id for m in sent)
    # Even with the transport headers gone, the body (or the broker's own id) is enough.
    for a in arrived:
        assert message_id_of(a.body, {}, native_id=a.native_id) in {m.wire.message_id for m in sent}
