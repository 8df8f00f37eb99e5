"""The latency histogram observed a batch at a time exports what observing each value would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from router.relay.metrics import LATENCY_BUCKETS, observe_all

# On bucket bounds, between them, past the last, zero and a repeat.
VALUES = [0.0, 0.001, 0.0011, 0.003, 0.003, 0.6, 2.5, 59.0, 301.0, 1e9]


def exported(multiprocess_dir: str | None = None) -> dict[str, list[str]]:
    """Samples of two histograms fed the same values, one in a batch, one by one."""
    registry = CollectorRegistry()
    children = {}
    for name in ("batch", "single"):
        histogram = Histogram(name, name, ["target"], buckets=LATENCY_BUCKETS, registry=registry)
        children[name] = histogram.labels("events")
    observe_all(children["batch"], VALUES)
    for value in VALUES:
        children["single"].observe(value)
    if multiprocess_dir:
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=multiprocess_dir)  # type: ignore[no-untyped-call]
    lines = generate_latest(registry).decode().splitlines()
    return {
        name: sorted(
            line.removeprefix(name)
            for line in lines
            if line.startswith(name + "_") and not line.startswith(name + "_created")
        )
        for name in ("batch", "single")
    }


def test_a_batch_counts_in_the_same_buckets_as_one_observation_each() -> None:
    samples = exported()
    assert samples["batch"] == samples["single"]
    assert '_bucket{le="0.001",target="events"} 2.0' in samples["batch"]
    assert '_count{target="events"} 10.0' in samples["batch"]


def test_with_workers_the_shared_files_add_up_the_same(tmp_path: Path) -> None:
    # prometheus_client picks its shared-file values when imported: a fresh interpreter.
    code = (
        "import json, sys; from tests.unit.test_metrics import exported; "
        "print(json.dumps(exported(sys.argv[1])))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        check=True,
    )
    samples = json.loads(result.stdout)
    assert list(tmp_path.glob("histogram_*.db"))
    assert samples["batch"] == samples["single"]
    assert '_bucket{le="+Inf",target="events"} 10.0' in samples["batch"]


def test_a_histogram_without_the_private_fields_is_observed_one_by_one() -> None:
    seen: list[float] = []

    class Plain:
        def observe(self, value: float) -> None:
            seen.append(value)

    observe_all(Plain(), VALUES)
    assert seen == VALUES
