"""stage: what stage() adds to the application's transaction.

    python -m bench.stage [--transactions 3000] [--bulk-transactions 100] [--repeat 3]
                          [--database postgresql|mysql|both] [--output stage]

In one SQLAlchemy AsyncSession, each transaction writes its events' rows and commits, either
through ``outbox.stage()`` (one INSERT with the NOTIFY, and the stream-key lock) or by hand
into the outbox a team would write itself (``bench._writers``' hand outbox: uuid, target,
type, key, jsonb payload, created_at, published_at; a partial index on the pending rows),
one row per event and target: a uuid4 and the event's JSON (``bench._writers.hand_row``), no
envelope, no NOTIFY, no lock. Two cases:

- one event per transaction, with 1 target (internal only) and 3 targets (internal + 2
  partners); by hand, one multi-row INSERT ... VALUES;
- keyed bulk: 1,000 events over 1,000 distinct stream keys per transaction, in one
  ``stage(..., stream_keys=...)`` call (one lock per key), 1 target. By hand, the fastest
  insert of 1,000 rows we can write on the same session and driver: one
  ``INSERT ... SELECT * FROM unnest(...)`` with one array parameter per column (5 binds,
  where a VALUES list needs 5,000), sent on the session's connection as stage() does. The
  events and keys are made once, outside the clock; each transaction still gets new ids and
  JSON, both variants.

Each hand statement is built once (per row count) and prepared once per connection: asyncpg
prepares every statement and SQLAlchemy's asyncpg dialect keeps them in its statement cache.
What stage() adds on top is the envelope it stores for the relay, the stream-key advisory
locks (per-stream commit order) and the ``pg_notify`` (waking the relay).

The two variants take turns every block of transactions (50 single-event ones, 5 bulk ones),
so drift (the disk's fsync time above all) hits them alike; the figure is the mean time per
transaction and the ratio of stage() to the hand-written insert, median of the rounds, with
the lowest and highest round's ratio as its spread.

On MariaDB (``--database mysql``, or ``both``: the two take turns case by case in every
round, each in a fresh database of its own), stage() writes its rows with one multi-row
``INSERT ... VALUES`` after an upsert of the stream keys into ``router_streams`` (the row
locks that keep per-stream commit order there; MySQL has no NOTIFY). By hand, in every case,
one multi-row ``INSERT ... VALUES`` into the hand outbox (MariaDB's: an index on
``(published_at, created_at)``) on the session's connection; asyncmy binds client-side, so
nothing is prepared on either side. Every round of every case starts from an empty
``router_streams``, so stage() inserts a stream's row the first time it sees its key (each
single-event transaction, the first bulk one) and only locks it afterwards, the same in every
round.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

from sqlalchemy import TextClause, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from bench._common import median, order, print_table, write_results
from bench._mysql import add_database_option, chosen, fresh_database, server_name, server_settings
from bench._writers import HandRow, create_tables, hand_insert, hand_row
from router import Event, Outbox
from tests.conftest import make_config

BROKERS: dict[int, dict[str, Any]] = {
    1: {"events": {"type": "memory", "internal": True}},
    3: {
        "events": {"type": "memory", "internal": True},
        "a": {"type": "memory"},
        "b": {"type": "memory"},
    },
}
BULK_EVENTS = 1000


@dataclass(frozen=True)
class Case:
    """One line of the table: how many targets, and what one transaction stages."""

    name: str
    targets: int
    bulk: bool
    block: int


CASES = (
    Case("1_targets", 1, bulk=False, block=50),
    Case("3_targets", 3, bulk=False, block=50),
    Case("keyed_bulk_1000", 1, bulk=True, block=5),
)
BULK_KEYS = [f"o-{n}" for n in range(BULK_EVENTS)]
BULK_ROWS = 64
"""More rows than this go by unnest() (one event has at most 3 rows here)."""


def work(case: Case, i: int, bulk: list[Event]) -> tuple[list[Event], dict[str, Any]]:
    """What the i-th transaction of a case stages: its events and their stream keys."""
    if case.bulk:
        return bulk, {"stream_keys": BULK_KEYS}
    return [order(i)], {"stream_key": f"o-{i}"}


def hand_rows(
    events: Sequence[Event], targets: Sequence[str], options: dict[str, Any]
) -> list[HandRow]:
    """The hand outbox's rows for what ``work`` stages: one per event and target."""
    keys = options.get("stream_keys") or [options.get("stream_key")] * len(events)
    return [
        hand_row(event, target, key)
        for event, key in zip(events, keys, strict=True)
        for target in targets
    ]


HAND_COLUMNS = ("id", "target", "type", "key", "payload")
HAND_BULK_INSERT = text(
    "INSERT INTO hand_outbox (id, target, type, key, payload) SELECT * FROM "
    "unnest(CAST(:id AS uuid[]), CAST(:target AS text[]), CAST(:type AS text[]), "
    "CAST(:key AS text[]), CAST(:payload AS jsonb[]))"
)


@functools.cache
def hand_values(count: int) -> TextClause:
    """The hand outbox's multi-row INSERT of ``count`` rows, made once per count (the driver
    prepares it once per connection)."""
    values = ", ".join(
        "(" + ", ".join(f":{column}{n}" for column in HAND_COLUMNS) + ")" for n in range(count)
    )
    return text(f"INSERT INTO hand_outbox ({', '.join(HAND_COLUMNS)}) VALUES {values}")


async def run_pair(url: str, case: Case, transactions: int) -> dict[bool, float]:
    """Mean seconds per transaction, by hand (True) and through stage() (False).

    The two variants take turns every ``case.block`` transactions on one session, so a slow
    spell of the disk (the commit's fsync is most of a transaction) hits both alike.
    """
    outbox = Outbox(make_config({"main": url}, BROKERS[case.targets]))
    sessions = async_sessionmaker(outbox.engine(pool_size=1), class_=AsyncSession)
    spent = dict.fromkeys((True, False), 0.0)
    bulk: list[Event] = [order(n) for n in range(BULK_EVENTS)] if case.bulk else []
    mysql = url.startswith("mysql")
    targets = list(BROKERS[case.targets])
    async with sessions() as session:
        if case.bulk:  # every round of the bulk case starts from the same, empty tables
            async with session.begin():
                await session.execute(text("TRUNCATE router_outbox"))
                await session.execute(text("TRUNCATE hand_outbox"))
        if mysql:  # and every round on MariaDB from no stream rows (see the module's doc)
            async with session.begin():
                await session.execute(text("TRUNCATE router_streams"))
        for first in range(0, transactions, case.block):
            turn = (True, False) if (first // case.block) % 2 == 0 else (False, True)
            for by_hand in turn:
                started = time.perf_counter()
                for i in range(first, min(first + case.block, transactions)):
                    events, options = work(case, i, bulk)
                    async with session.begin():
                        if by_hand and mysql:
                            await insert_by_hand_mysql(session, hand_rows(events, targets, options))
                        elif by_hand:
                            await insert_by_hand(session, hand_rows(events, targets, options))
                        else:
                            await outbox.stage(session, *events, **options)
                spent[by_hand] += time.perf_counter() - started
    await outbox.close()
    return {by_hand: seconds / transactions for by_hand, seconds in spent.items()}


async def insert_by_hand(session: AsyncSession, rows: Sequence[HandRow]) -> None:
    """The hand outbox's rows in one statement on the session's connection (the path stage()
    takes, without the ORM session's per-statement work).

    One event: a multi-row INSERT ... VALUES. Keyed bulk (more than 64 rows): the strongest
    hand-written alternative, :data:`HAND_BULK_INSERT`, one INSERT ... SELECT FROM unnest()
    of one array per column. No stream-key advisory lock and no NOTIFY, both of which stage()
    does, for per-stream commit order and to wake the relay.
    """
    connection = await session.connection()
    if len(rows) > BULK_ROWS:
        columns = [list(column) for column in zip(*rows, strict=True)]
        await connection.execute(HAND_BULK_INSERT, dict(zip(HAND_COLUMNS, columns, strict=True)))
        return
    params = {
        f"{column}{n}": value
        for n, row in enumerate(rows)
        for column, value in zip(HAND_COLUMNS, row, strict=True)
    }
    await connection.execute(hand_values(len(rows)), params)


async def insert_by_hand_mysql(session: AsyncSession, rows: Sequence[HandRow]) -> None:
    """On MariaDB, the hand outbox's rows in one multi-row INSERT ... VALUES on the session's
    connection (ids as text: MariaDB's UUID type reads them)."""
    connection = await session.connection()
    await connection.exec_driver_sql(
        hand_insert(len(rows), "mysql"), tuple(v for r in rows for v in (str(r[0]), *r[1:]))
    )


Results = dict[tuple[str, bool], list[float]]
"""Seconds per transaction of each round, by (case, by hand)."""


async def measure(kinds: Sequence[str], args: argparse.Namespace) -> dict[str, Results]:
    """Every round of every case on each database, the databases taking turns case by case."""
    results: dict[str, Results] = {kind: {} for kind in kinds}
    async with AsyncExitStack() as stack:
        urls = {
            kind: await stack.enter_async_context(fresh_database(kind, "stage")) for kind in kinds
        }
        for kind, url in urls.items():
            create_tables(kind, url)  # the hand outbox
        for _ in range(args.repeat):
            for case in CASES:
                count = args.bulk_transactions if case.bulk else args.transactions
                for kind in kinds:
                    pair = await run_pair(urls[kind], case, count)
                    for by_hand, seconds in pair.items():
                        results[kind].setdefault((case.name, by_hand), []).append(seconds)
    return results


def summarise(results: Results) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """One database's figures per case, and its cells of the table's rows."""
    figures: dict[str, Any] = {}
    cells: dict[str, list[str]] = {}
    for case in CASES:
        hands, stages = results[(case.name, True)], results[(case.name, False)]
        hand, staged = median(hands) * 1e6, median(stages) * 1e6
        ratios = [s / h for s, h in zip(stages, hands, strict=True)]
        figures[case.name] = {
            "by_hand_us": round(hand, 1),
            "stage_us": round(staged, 1),
            "ratio": round(staged / hand, 3),
            "ratio_min": round(min(ratios), 3),
            "ratio_max": round(max(ratios), 3),
        }
        cells[case.name] = [
            f"{hand:,.0f}",
            f"{staged:,.0f}",
            f"{staged / hand:.2f}x",
            f"{min(ratios):.2f}-{max(ratios):.2f}x",
        ]
    return figures, cells


async def main() -> None:
    """Measure, print, save."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transactions", type=int, default=3000)
    parser.add_argument("--bulk-transactions", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    add_database_option(parser)
    parser.add_argument("--output", default="stage", help="bench/results/OUTPUT.json")
    args = parser.parse_args()
    kinds = chosen(args.database)
    names = {"postgresql": "PostgreSQL"}
    parameters: dict[str, Any] = {
        "transactions": args.transactions,
        "bulk_transactions": args.bulk_transactions,
        "bulk_events": BULK_EVENTS,
        "repeat": args.repeat,
        "database": args.database,
    }
    if "mysql" in kinds:
        parameters["mysql_server"] = await server_settings()
        names["mysql"] = server_name(parameters["mysql_server"]["version"])
    summaries = {kind: summarise(results) for kind, results in (await measure(kinds, args)).items()}

    header = ["targets"]
    for kind in kinds:
        named = f"{names[kind]}: " if len(kinds) > 1 else ""
        header += [f"{named}rows by hand (us/tx)", "stage() (us/tx)", "ratio", "rounds"]
    rows = []
    for case in CASES:
        label = f"{case.targets} ({BULK_EVENTS:,} events, keyed)" if case.bulk else case.targets
        rows.append([label, *(cell for kind in kinds for cell in summaries[kind][1][case.name])])
    where = "" if kinds == ("postgresql",) else ", " + " and ".join(names[k] for k in kinds)
    print_table(
        f"stage: AsyncSession{where}, median of {args.repeat} rounds x {args.transactions:,} "
        f"transactions ({args.bulk_transactions:,} keyed bulk ones)",
        header,
        rows,
    )
    figures = (
        summaries[kinds[0]][0]
        if len(kinds) == 1
        else {kind: figures for kind, (figures, _) in summaries.items()}
    )
    path = write_results(args.output, parameters, figures)
    print(f"written to {path.relative_to(path.parents[2])}")


if __name__ == "__main__":
    asyncio.run(main())
