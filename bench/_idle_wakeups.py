"""``bench.write_concurrency --idle-wakeups``: how soon an idle relay delivers a commit.

Per database (PostgreSQL, MariaDB, SQLite; fresh, migrated), one ``router serve`` (its
``wakeup`` left at ``auto``) delivers to a fresh memory stream on the shared NATS server. This
process stages one event per transaction (``Outbox.transaction()``, its own connection) after
the relay sat idle for each gap (counted from the previous event's arrival; the gaps' order
rotated per round), and times it from the COMMIT's return to its arrival at a subscriber of
the stream's subjects. One uncounted event first, which also waits out the relay's start.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats

from bench import _mysql
from bench._common import (
    NATS_URL,
    RouterProcess,
    fresh_stream,
    median,
    order,
    print_table,
    router_config,
)
from router import Outbox
from router.config import DatabaseSettings
from router.ops.migrate import upgrade
from tests.conftest import make_config

__all__ = ["idle_wakeups", "report_wakeups"]

KINDS = ("postgresql", "mysql", "sqlite")
START_TIMEOUT = 60.0


@contextlib.asynccontextmanager
async def fresh_database(kind: str) -> AsyncIterator[str]:
    """``_mysql.fresh_database``, and a migrated SQLite file in a folder of its own."""
    if kind != "sqlite":
        async with _mysql.fresh_database(kind, "wake") as url:
            yield url
        return
    with tempfile.TemporaryDirectory(prefix="bench-wake-") as folder:
        url = f"sqlite:///{folder}/outbox.db"
        await upgrade("main", DatabaseSettings.model_validate({"url": url}), Path(folder))
        yield url


class Arrivals:
    """A subscriber on the stream's subjects: when each message id arrived."""

    def __init__(self) -> None:
        self.seen: dict[str, float] = {}
        self.changed = asyncio.Event()

    async def on_message(self, msg: Any) -> None:
        """Note the arrival time."""
        self.seen.setdefault(msg.headers["Nats-Msg-Id"], time.time())
        self.changed.set()

    async def wait(self, message_id: str, timeout: float) -> float:
        """When ``message_id`` arrived."""
        deadline = time.monotonic() + timeout
        while message_id not in self.seen:
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), max(0.0, deadline - time.monotonic()))
        return self.seen[message_id]


async def one_database(kind: str, gaps: list[float], rounds: int) -> dict[str, list[float]]:
    """Latencies in ms per gap, in round order, on a fresh database of ``kind``."""
    latencies: dict[str, list[float]] = {f"{gap:g}": [] for gap in gaps}
    async with fresh_database(kind) as url, fresh_stream(f"wake_{kind}") as stream:
        settings = router_config(url, stream)
        outbox = Outbox(make_config(settings["databases"], settings["brokers"]))
        arrivals, client = Arrivals(), await nats.connect(NATS_URL)
        try:
            await client.subscribe(stream.subject + ".>", cb=arrivals.on_message)
            with RouterProcess(settings):
                await _commit_and_wait(outbox, arrivals, 0, START_TIMEOUT)
                n = 1
                for round_ in range(rounds):
                    for gap in gaps[round_ % len(gaps) :] + gaps[: round_ % len(gaps)]:
                        await asyncio.sleep(gap)
                        ms = await _commit_and_wait(outbox, arrivals, n, gap + 30)
                        latencies[f"{gap:g}"].append(ms)
                        n += 1
                        print(
                            f"  {kind} round {round_ + 1} gap {gap:g} s: {ms:,.1f} ms", flush=True
                        )
        finally:
            await client.close()
            await outbox.close()
    return latencies


async def _commit_and_wait(outbox: Outbox, arrivals: Arrivals, n: int, timeout: float) -> float:
    """Stage order ``n`` in a transaction of its own; ms from the commit to its arrival."""
    async with outbox.transaction() as tx:
        [message_id] = await tx.stage(order(n), stream_key=f"order-{n}")
    committed = time.time()
    return (await arrivals.wait(message_id, timeout) - committed) * 1e3


async def idle_wakeups(gaps: list[float], rounds: int) -> dict[str, Any]:
    """Per database, per gap: commit-to-arrival ms, median and range of the rounds."""
    figures: dict[str, Any] = {}
    for kind in KINDS:
        per_gap = await one_database(kind, gaps, rounds)
        figures[kind] = {
            gap: {
                "median_ms": round(median(ms), 1),
                "min_ms": round(min(ms), 1),
                "max_ms": round(max(ms), 1),
                "runs_ms": [round(m, 1) for m in ms],
            }
            for gap, ms in per_gap.items()
        }
    return figures


def report_wakeups(figures: dict[str, Any], rounds: int) -> None:
    """The table: one line per database and gap."""
    rows = [
        [kind, f"{gap} s", f"{f['median_ms']:,.1f}", f"{f['min_ms']:,.1f}-{f['max_ms']:,.1f}"]
        for kind, per_gap in figures.items()
        for gap, f in per_gap.items()
    ]
    print_table(
        f"write_concurrency --idle-wakeups: commit to arrival at a NATS subscriber after the "
        f"relay sat idle, ms, median of {rounds} rounds",
        ["database", "idle gap", "median ms", "range ms"],
        rows,
    )
