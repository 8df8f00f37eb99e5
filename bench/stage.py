"""stage: what stage() adds to the application's transaction.

    python -m bench.stage [--transactions 3000] [--repeat 3]

In one SQLAlchemy AsyncSession, each transaction writes one event's rows and commits, either
through ``outbox.stage()`` (one INSERT with the NOTIFY, and the stream-key lock) or by
inserting the very same rows by hand (a plain multi-row INSERT, no NOTIFY). With 1 target
(internal only) and 3 targets (internal + 2 partners). The two variants take turns every 50
transactions, so drift (the disk's fsync time above all) hits them alike; the figure is the
mean time per transaction and the ratio of stage() to the hand-written insert, median of the
rounds.
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


async def run_pair(url: str, targets: int, transactions: int, block: int = 50) -> dict[bool, float]:
    """Mean seconds per transaction, by hand (True) and through stage() (False).

    The two variants take turns every ``block`` transactions on one session, so a slow spell
    of the disk (the commit's fsync is most of a transaction) hits both alike.
    """
    outbox = Outbox(make_config({"main": url}, BROKERS[targets]))
    sessions = async_sessionmaker(outbox.engine(pool_size=1), class_=AsyncSession)
    stager = outbox._stager
    spent = dict.fromkeys((True, False), 0.0)
    async with sessions() as session:
        for first in range(0, transactions, block):
            turn = (True, False) if (first // block) % 2 == 0 else (False, True)
            for by_hand in turn:
                started = time.perf_counter()
                for i in range(first, min(first + block, transactions)):
                    event = order(i)
                    async with session.begin():
                        if by_hand:
                            rows = stager.build_rows(
                                "main", [event], StagingOptions(stream_key=f"o-{i}")
                            )
                            params = {
                                f"{f}{n}": getattr(r, name)
                                for n, r in enumerate(rows)
                                for f, name in FIELDS
                            }
                            await session.execute(hand_insert(len(rows)), params)
                        else:
                            await outbox.stage(session, event, stream_key=f"o-{i}")
                spent[by_hand] += time.perf_counter() - started
    await outbox.close()
    return {by_hand: seconds / transactions for by_hand, seconds in spent.items()}


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
                pair = await run_pair(url, targets, args.transactions)
                for by_hand, seconds in pair.items():
                    results.setdefault((targets, by_hand), []).append(seconds)
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
