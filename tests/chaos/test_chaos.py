"""The chaos run's small size, as part of the test suite (the full size: see chaos.py)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from tests.chaos.chaos import run_chaos
from tests.services import POSTGRES, require


async def test_small_chaos_run_loses_nothing_and_keeps_every_stream_in_order(
    tmp_path: Path,
) -> None:
    require("PostgreSQL", POSTGRES)  # the run brings its own NATS server
    report = await run_chaos("small", tmp_path)
    (tmp_path / "chaos-small.json").write_text(json.dumps(asdict(report), indent=2))
    print(report.table())
    assert report.committed >= 4000
    assert report.worker_kills >= 10
    assert report.broker_restarts == 1
    assert report.database_restarts == 1
    assert report.lost == 0, report.lost_ids
    assert report.order_violations == 0, report.violations
    assert report.duplicates_not_in_flight == 0, report.unexplained_duplicates
    assert report.delivered == report.committed
