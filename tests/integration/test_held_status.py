"""Held and parked stream keys in sight, on PostgreSQL, SQLite and MariaDB: ``router status``
counts them with the oldest head's wait, ``/metrics`` has them as gauges, and the console
calls their target unhealthy until they are released."""

from __future__ import annotations

import pytest

from router.cli.status import _human
from router.ops.held import release
from router.ops.status import status
from router.relay.metrics import BacklogCollector
from router.serve.console import _target
from tests.conftest import Database
from tests.integration.test_held import config_of, keep_the_second, opened, stage


def gauges(rows: list[object]) -> dict[str, float]:
    """The backlog gauges of the one target, by metric name."""
    collector = BacklogCollector()
    collector.rows = rows
    return {
        family.name: family.samples[0].value for family in collector.collect() if family.samples
    }


@pytest.mark.parametrize("kept", ["held", "parked"])
async def test_a_stopped_key_shows_in_status_metrics_and_the_console_until_released(
    database: Database, kept: str
) -> None:
    await stage(database, 1, 2, 3)
    config = config_of(database)
    async with opened(database) as store:
        await keep_the_second(database, store, kept)

    [row] = await status(config)
    assert (row.held_keys, row.parked_keys) == ((1, 0) if kept == "held" else (0, 1))
    assert (row.held, row.parked) == ((1, 0) if kept == "held" else (0, 2))
    assert row.oldest_held_age is not None and row.oldest_held_age >= 0
    assert row.abandoned == 0
    assert _target(row, {}, {})["healthy"] is False
    metrics = gauges([row])
    assert metrics["router_held_keys"] == (1.0 if kept == "held" else 0.0)
    assert metrics["router_parked_keys"] == (1.0 if kept == "parked" else 0.0)
    assert metrics["router_parked_rows"] == (2.0 if kept == "parked" else 0.0)
    assert metrics["router_oldest_held_age_seconds"] >= 0
    shown = _human([row])
    assert f"main/events: 1 {kept} key" in shown and "router release" in shown
    [quick] = await status(config, published=False)  # what metrics and the console poll
    assert (quick.held_keys, quick.parked_keys) == (row.held_keys, row.parked_keys)

    await release(config, "events", "k", reason="fixed", actor="test")
    [after] = await status(config)
    assert (after.held_keys, after.parked_keys, after.oldest_held_age) == (0, 0, None)
    assert _target(after, {}, {})["healthy"] is True
    assert "keys stopped" not in _human([after])
