"""stage: what stage() adds to the application's transaction.

    python -m bench.stage [--transactions 3000] [--repeat 3]

In one SQLAlchemy AsyncSession per variant, each transaction writes one event's rows and
commits, either through ``outbox.stage()`` (one INSERT with the NOTIFY, and the stream-key
lock) or by inserting the very same rows by hand (a plain multi-row INSERT, no NOTIFY). With 1
target (internal only) and 3 targets (internal + 2 partners). Variants are interleaved so
drift hits them alike; the figure is the mean time per transaction and the ratio of stage()
to the hand-written insert.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from sqlalchemy import TextClause, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from bench._common import fresh_database, median, order, print_table, write_results
from router import Outbox
from router.staging import StagingOptions
from tests.conftest import make_config

BROKERS: dict[int, dict[str, Any]] = {
    1: {"events": {"type": "memory", "internal": True}},
    3: {
        "events": {"type": "memory", "internal": True},
        "a": {"type": "memory"},
        "b": {"type": "memory"},
    },
}


FIELDS = (
    ("m", "message_id"),
    ("t", "target"),
    ("d", "destination"),
    ("e", "event_type"),
    ("k", "stream_key"),
    ("v", "envelope"),
)


def hand_insert(count: int) -> TextClause:
    """The same rows as stage() writes, as a hand-written multi-row INSERT."""
    values = ", ".join(
        f"(CAST(:m{n} AS uuid), :t{n}, :d{n}, :e{n}, :k{n}, CAST(:v{n} AS json))"
        for n in range(count)
    )
    return text(
        "INSERT INTO router_outbox (message_id, target, destination, event_type, "
        f"stream_key, envelope) VALUES {values}"
    )


async def run_variant(url: str, targets: int, by_hand: bool, transactions: int) -> float:
    """Mean seconds per transaction."""
    outbox = Outbox(make_config({"main": url}, BROKERS[targets]))
    sessions = async_sessionmaker(outbox.engine(pool_size=1), class_=AsyncSession)
    stager = outbox._stager
    async with sessions() as session:
        started = time.perf_counter()
        for i in range(transactions):
            event = order(i)
            async with session.begin():
                if by_hand:
                    rows = stager.build_rows("main", [event], StagingOptions(stream_key=f"o-{i}"))
                    params = {
                        f"{f}{n}": getattr(r, name)
                        for n, r in enumerate(rows)
                        for f, name in FIELDS
                    }
                    await session.execute(hand_insert(len(rows)), params)
                else:
                    await outbox.stage(session, event, stream_key=f"o-{i}")
        elapsed = time.perf_counter() - started
    await outbox.close()
    return elapsed / transactions


async def main() -> None:
    """Measure, print, save."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transactions", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    results: dict[tuple[int, bool], list[float]] = {}
    async with fresh_database("stage") as url:
        for _ in range(args.repeat):
            for targets in (1, 3):
                for by_hand in (True, False):
                    results.setdefault((targets, by_hand), []).append(
                        await run_variant(url, targets, by_hand, args.transactions)
                    )
    rows, figures = [], {}
    for targets in (1, 3):
        hand = median(results[(targets, True)]) * 1e6
        staged = median(results[(targets, False)]) * 1e6
        figures[f"{targets}_targets"] = {
            "by_hand_us": round(hand, 1),
            "stage_us": round(staged, 1),
            "ratio": round(staged / hand, 3),
        }
        rows.append((targets, f"{hand:,.0f}", f"{staged:,.0f}", f"{staged / hand:.2f}x"))
    print_table(
        f"stage: one event per transaction, AsyncSession, median of {args.repeat} x "
        f"{args.transactions:,} transactions",
        ["targets", "rows by hand (us/tx)", "stage() (us/tx)", "ratio"],
        rows,
    )
    path = write_results(
        "stage", {"transactions": args.transactions, "repeat": args.repeat}, figures
    )
    print(f"written to {path.relative_to(path.parents[2])}")


if __name__ == "__main__":
    asyncio.run(main())
