"""The chaos run's small size, as part of the test suite (the full size: see chaos.py)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from tests.chaos.chaos import run_chaos
from tests.chaos.databases import MARIADB_PROGRAMS
from tests.services import POSTGRES, require, require_programs


@pytest.mark.parametrize("database", ["postgresql", "mysql"])
async def test_small_chaos_run_loses_nothing_and_keeps_every_stream_in_order(
    database: str, tmp_path: Path
) -> None:
    # The run brings its own NATS server, and on MariaDB its own mariadbd (the one it crashes).
    if database == "postgresql":
        require("PostgreSQL", POSTGRES)
    else:
        require_programs("MariaDB", *MARIADB_PROGRAMS)
    report = await run_chaos("small", tmp_path, database)
    (tmp_path / f"chaos-small-{database}.json").write_text(json.dumps(asdict(report), indent=2))
    print(report.table())
    assert report.committed >= 4000
    assert report.worker_kills >= 10
    assert report.broker_restarts == 1
    assert report.database_restarts == 1
    assert report.lost == 0, report.lost_ids
    assert report.order_violations == 0, report.violations
    assert report.duplicates_not_in_flight == 0, report.unexplained_duplicates
    assert report.delivered == report.committed


async def test_inbox_consumer_turns_duplicate_deliveries_into_single_effects(
    tmp_path: Path,
) -> None:
    require("PostgreSQL", POSTGRES)
    # Acks held back 0.3 s (a slow network): a worker killed mid-batch leaves messages the
    # broker stored but the router never saw acknowledged; they are sent again. The stream's
    # dedup window is too short to absorb them, so the consumer does receive them twice.
    report = await run_chaos(
        "small", tmp_path, events=1500, rate=60.0, kill_every=3.0, inbox=True, ack_delay=0.3
    )
    print(report.table())
    assert report.lost == 0, report.lost_ids
    assert report.order_violations == 0, report.violations
    assert report.duplicate_deliveries > 0
    assert report.duplicate_effects == 0
    assert report.effects == report.committed
