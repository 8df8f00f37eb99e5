"""The predictive figures (router.ops.flow) on every database kind, against real NATS:
staged and published a second over the last minute, the share delivered within the target's
SLO, time to empty, new vs retrying rows, and the same figures as /metrics gauges."""

from __future__ import annotations

import math
from decimal import Decimal

from prometheus_client import CollectorRegistry

from router import Outbox
from router.ops.outbox import set_paused
from router.ops.status import TargetStatus, status
from router.relay.metrics import BacklogCollector
from tests.conftest import Database, NatsStreams, make_config, nats_broker
from tests.integration.events import OrderPlaced
from tests.integration.test_delivery import serving, wait_until

EVENTS = 30


async def by_target(config: object) -> dict[str, TargetStatus]:
    return {r.target: r for r in await status(config)}  # type: ignore[arg-type]


async def test_flow_figures_and_gauges(database: Database, nats_streams: NatsStreams) -> None:
    config = make_config(
        {"main": database.url},
        {
            "events": nats_broker(nats_streams.stream("internal"), internal=True, slo_seconds=60),
            # An SLO nothing meets, and a rate limit and backlog rule to show.
            "strict": nats_broker(
                nats_streams.stream("strict"),
                slo_seconds=0.000001,
                rate_limit=500,
                on_backlog={"max_rows": 10, "action": "alert"},
            ),
        },
        database.base_dir,
    )
    outbox = Outbox(config)
    async with outbox.transaction() as tx:
        await tx.stage(*(OrderPlaced(order_id=f"o-{i}", total=Decimal(i)) for i in range(EVENTS)))

    queued = await by_target(config)
    for row in queued.values():
        assert (row.new, row.retrying, row.staged_per_second) == (EVENTS, 0, EVENTS / 60)
        assert row.published_per_second == 0 and row.time_to_empty_seconds is None  # stalled
    assert queued["strict"].as_dict()["new"] == EVENTS

    async with serving(config):

        async def delivered() -> bool:
            return all(r.published == EVENTS for r in (await by_target(config)).values())

        await wait_until(delivered, timeout=20)
    done = await by_target(config)
    events, strict = done["events"], done["strict"]
    assert events.published_per_second > 0 and events.time_to_empty_seconds == 0.0
    assert (events.delivered_within_slo, strict.delivered_within_slo) == (1.0, 0.0)
    assert (events.rate_limit, strict.rate_limit) == (
        None,
        {"messages_per_second": 500, "burst": 500},
    )
    assert strict.on_backlog == {"max_rows": 10, "action": "alert"}
    assert strict.max_in_flight == 2000  # the NATS adapter's default

    collector = BacklogCollector()
    collector.rows = list(done.values())
    registry = CollectorRegistry()
    registry.register(collector)

    def gauge(name: str, target: str) -> float:
        value = registry.get_sample_value(name, {"database": "main", "target": target})
        assert value is not None, name
        return value

    assert gauge("router_delivered_within_slo_ratio", "strict") == 0.0
    assert gauge("router_time_to_empty_seconds", "events") == 0.0
    assert gauge("router_rate_limit_messages_per_second", "strict") == 500
    assert gauge("router_backlog_limit_rows", "strict") == 10
    assert gauge("router_backlog_over_limit", "strict") == 0

    # Published more than a minute ago: out of the window. A paused target with a queue
    # never empties.
    await database.execute(
        "UPDATE router_outbox SET published_at = '2026-01-01 00:00:00',"
        " created_at = '2026-01-01 00:00:00'"
    )
    async with outbox.transaction() as tx:
        await tx.stage(*(OrderPlaced(order_id=f"n-{i}", total=Decimal(i)) for i in range(12)))
    await set_paused(config, "strict", paused=True)
    later = await by_target(config)
    assert later["events"].published_per_second == 0
    assert later["events"].delivered_within_slo is None
    assert later["strict"].time_to_empty_seconds is None
    collector.rows = list(later.values())
    assert math.isinf(gauge("router_time_to_empty_seconds", "strict"))
    assert math.isnan(gauge("router_delivered_within_slo_ratio", "events"))
    assert gauge("router_backlog_over_limit", "strict") == 1
    await outbox.close()
