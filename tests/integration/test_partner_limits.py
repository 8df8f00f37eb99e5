"""Per-partner controls on every database kind, against real NATS: a partner's ``rate_limit``
paces only that partner (JetStream's own timestamps show the pace), and ``on_backlog`` alerts
or pauses a target whose queue runs away, without overruling an operator who resumes it."""

from __future__ import annotations

import logging
from decimal import Decimal

import nats
import pytest

from router import Outbox
from router.ops.outbox import set_paused
from router.ops.status import status
from router.serve.backlog import BacklogWatch
from tests.conftest import NATS_URL, Database, NatsStreams, make_config, nats_broker
from tests.integration.events import OrderPlaced
from tests.integration.test_delivery import serving, wait_until

EVENTS, RATE, BURST = 120, 100, 20


async def stored_times(stream: str, count: int) -> list[float]:
    client = await nats.connect(NATS_URL)
    try:
        js = client.jetstream()
        found = [(await js.get_msg(stream, seq=i)).time for i in range(1, count + 1)]
    finally:
        await client.close()
    assert all(found), "JetStream stores a time with every message"
    return [t.timestamp() for t in found if t is not None]


async def stage(outbox: Outbox, events: int) -> None:
    async with outbox.transaction() as tx:
        await tx.stage(*(OrderPlaced(order_id=f"o-{i}", total=Decimal(i)) for i in range(events)))


async def test_a_rate_limit_paces_only_its_partner(
    database: Database, nats_streams: NatsStreams
) -> None:
    limit = {"messages_per_second": RATE, "burst": BURST}
    config = make_config(
        {"main": database.url},
        {
            "events": nats_broker(nats_streams.stream("internal"), internal=True),
            "slow": nats_broker(nats_streams.stream("slow"), rate_limit=limit),
        },
        database.base_dir,
    )
    internal, slow = (name for name in nats_streams.created)
    outbox = Outbox(config)
    await stage(outbox, EVENTS)
    async with serving(config) as supervisor:

        async def delivered() -> bool:
            rows = {r.target: r for r in await status(config)}
            return all(r.published == EVENTS for r in rows.values())

        await wait_until(delivered, timeout=10 * EVENTS / RATE)
        registry = supervisor.metrics.registry
    await outbox.close()

    fast = await stored_times(internal, EVENTS)
    paced = await stored_times(slow, EVENTS)
    assert fast[-1] - fast[0] < (EVENTS - BURST) / RATE / 2  # the internal broker is not held
    # A token bucket: from the first message on, the n-th went out no earlier than the
    # burst plus n / rate allows (a little slack for the two clocks).
    start = paced[0]
    early = [n for n, t in enumerate(paced) if t - start < (n - BURST) / RATE - 0.05]
    assert not early, early
    assert paced[-1] - start < 2 * (EVENTS - BURST) / RATE + 1  # and not much slower
    held = registry.get_sample_value(
        "router_rate_limited_seconds_total", {"database": "main", "target": "slow"}
    )
    assert held is not None and held > 0.5 * (EVENTS - BURST) / RATE


@pytest.mark.parametrize("action", ["alert", "pause"])
async def test_a_runaway_backlog_alerts_or_pauses_its_target(
    database: Database,
    nats_streams: NatsStreams,
    action: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = make_config(
        {"main": database.url},
        {
            "events": nats_broker(nats_streams.stream("internal"), internal=True),
            "partner": nats_broker(
                nats_streams.stream("partner"), on_backlog={"max_rows": 5, "action": action}
            ),
        },
        database.base_dir,
    )
    outbox = Outbox(config)
    watch = BacklogWatch(config, interval=0.05)
    caplog.set_level(logging.INFO, logger="router.serve.backlog")

    async def check() -> None:
        async with watch._engines() as engines:
            await watch.check(engines["main"], "main", "partner", watch.rules["main", "partner"])

    async def paused() -> bool:
        return next(r for r in await status(config) if r.target == "partner").paused

    await stage(outbox, 5)
    await check()  # at the line: nothing happens
    assert not caplog.records and not await paused()
    await stage(outbox, 1)
    await check()
    await check()  # still over: said once
    assert [r.message for r in caplog.records] == ["backlog.over_limit"] + (
        ["backlog.paused"] if action == "pause" else []
    )
    assert await paused() == (action == "pause")
    audit = await database.execute("SELECT actor, action, target FROM router_audit")
    expected = [("router (on_backlog)", "pause", "partner")] if action == "pause" else []
    assert [(r["actor"], r["action"], r["target"]) for r in audit] == expected

    if action == "pause":
        # The operator resumes it to drain: the rule does not pause it again while it drains.
        await set_paused(config, "partner", paused=False)
        await check()
        assert not await paused()
        async with serving(config):

            async def drained() -> bool:
                return next(r for r in await status(config) if r.target == "partner").published == 6

            await wait_until(drained, timeout=10)
        await check()  # back under the line: armed again
        await stage(outbox, 6)
        await check()
        assert await paused()
    await outbox.close()
