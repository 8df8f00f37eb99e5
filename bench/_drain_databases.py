"""drain on PostgreSQL and MariaDB side by side (``--database mysql`` or ``both``).

The method bench.drain used before its PostgreSQL figures moved to relays timed from exec
(bench._drain_runs), kept as it was so the two databases are compared under one method: each
measurement stages a fresh backlog, then ``router serve`` (a subprocess) or a hand-written
relay running inside the bench process drains it into a memory-storage stream, timed from
the first message stored to the last. With ``both`` the databases take turns relay by relay
in every round, each measurement on a fresh database of its own.

On PostgreSQL that relay claims through a CTE (``BASELINE_CLAIM``); on MariaDB it is the same
relay on asyncmy (``MYSQL_CLAIM``): the oldest 500 open rows locked by primary key with
``SKIP LOCKED`` and leased in one short transaction, published with acks in flight, marked
with one UPDATE.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import asyncpg
import nats

from bench import _mysql
from bench._common import (
    NATS_URL,
    RouterProcess,
    fresh_stream,
    median,
    print_table,
    router_config,
    wait_for_count,
)
from bench._drain_runs import stage_backlog

__all__ = ["Runs", "across", "compare", "measure", "print_drain_table", "summarise"]

BASELINE_CLAIM = """
WITH picked AS (
    SELECT seq FROM router_outbox
    WHERE target = 'events' AND status IN ('pending', 'failed') AND available_at <= now()
    ORDER BY seq LIMIT $1
    FOR UPDATE SKIP LOCKED
)
UPDATE router_outbox AS o
SET status = 'processing', locked_until = now() + interval '30 seconds',
    attempts = o.attempts + 1
FROM picked WHERE o.seq = picked.seq
RETURNING o.seq, o.message_id::text, o.destination, o.envelope::text
"""
BASELINE_MARK = """
UPDATE router_outbox SET status = 'published', published_at = now(), locked_until = NULL
WHERE seq = ANY($1::bigint[])
"""

# BASELINE_CLAIM's twin on MariaDB, which has neither UPDATE ... RETURNING nor SKIP LOCKED
# outside a SELECT: the rows are picked and locked by one SELECT, leased by an UPDATE, in one
# transaction. The oldest open rows are read one status at a time in the order of
# ix_router_outbox_claim (target, status, seq) and not locked; the join then locks them by
# primary key and skips the ones another relay holds. (``status IN ('pending', 'failed')
# ORDER BY seq`` would sort every open row for each claim: 25 to 50 ms at 10,000 open rows,
# where this takes 3 to 6.)
MYSQL_OPEN = """
    (SELECT seq FROM router_outbox FORCE INDEX (ix_router_outbox_claim)
     WHERE target = 'events' AND status = '{status}' AND available_at <= UTC_TIMESTAMP(6)
     ORDER BY seq LIMIT %s)"""
MYSQL_CLAIM = f"""
SELECT o.seq, o.message_id, o.destination, o.envelope
FROM ({MYSQL_OPEN.format(status="pending")} UNION ALL {MYSQL_OPEN.format(status="failed")}
      ORDER BY seq LIMIT %s) AS picked
JOIN router_outbox AS o FORCE INDEX (PRIMARY) ON o.seq = picked.seq
WHERE o.status IN ('pending', 'failed') AND o.available_at <= UTC_TIMESTAMP(6)
ORDER BY o.seq
FOR UPDATE SKIP LOCKED
"""
MYSQL_LEASE = """
UPDATE router_outbox SET status = 'processing',
    locked_until = UTC_TIMESTAMP(6) + INTERVAL 30 SECOND, attempts = attempts + 1
WHERE seq IN ({seqs})
"""
MYSQL_MARK = """
UPDATE router_outbox SET status = 'published', published_at = UTC_TIMESTAMP(6),
    locked_until = NULL
WHERE seq IN ({seqs})
"""


async def run_router(kind: str, events: int, workers: int) -> float:
    """Events/s of ``router serve --workers N`` draining a fresh backlog."""
    async with _mysql.fresh_database(kind, "drain") as url, fresh_stream("drain") as stream:
        await stage_backlog(url, stream, events)
        config = router_config(url, stream, batch_size=500)
        with RouterProcess(config, "--workers", str(workers)):
            first, last = await wait_for_count(stream, events)
        return events / (last - first) if last > first else float("inf")


async def run_baseline(kind: str, events: int, batch: int = 500) -> float:
    """Events/s of the hand-written relay on an identical backlog."""
    async with _mysql.fresh_database(kind, "base") as url, fresh_stream("base") as stream:
        await stage_backlog(url, stream, events)
        timing = asyncio.create_task(wait_for_count(stream, events))
        await (baseline_relay_mysql if kind == "mysql" else baseline_relay)(url, batch)
        first, last = await timing
        return events / (last - first) if last > first else float("inf")


async def baseline_relay(url: str, batch: int) -> None:
    """Claim, publish with acks in flight, mark; until the outbox is empty."""
    conn = await asyncpg.connect(url)
    client = await nats.connect(NATS_URL)
    js = client.jetstream(publish_async_max_pending=batch * 2)
    try:
        while True:
            rows = await conn.fetch(BASELINE_CLAIM, batch)
            if not rows:
                return
            futures = [
                await js.publish_async(r[2], r[3].encode(), headers={"Nats-Msg-Id": r[1]})
                for r in rows
            ]
            await asyncio.gather(*futures)
            await conn.execute(BASELINE_MARK, [r[0] for r in rows])
    finally:
        await client.close()
        await conn.close()


async def baseline_relay_mysql(url: str, batch: int) -> None:
    """``baseline_relay`` on MariaDB, with asyncmy: claim (``MYSQL_CLAIM``) and lease in one
    transaction, publish with acks in flight, mark; until the outbox is empty."""
    conn = await _mysql.connect(url, autocommit=True)
    client = await nats.connect(NATS_URL)
    js = client.jetstream(publish_async_max_pending=batch * 2)
    try:
        async with conn.cursor() as cursor:
            # As the router's store: no gap locks, so a claim never holds up an insert.
            await cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
            while True:
                await conn.begin()
                await cursor.execute(MYSQL_CLAIM, [batch, batch, batch])
                rows = await cursor.fetchall()
                if not rows:
                    await conn.commit()
                    return
                seqs = [r[0] for r in rows]
                marks = ", ".join(["%s"] * len(seqs))
                await cursor.execute(MYSQL_LEASE.format(seqs=marks), seqs)
                await conn.commit()
                futures = [
                    await js.publish_async(r[2], r[3].encode(), headers={"Nats-Msg-Id": r[1]})
                    for r in rows
                ]
                await asyncio.gather(*futures)
                await cursor.execute(MYSQL_MARK.format(seqs=marks), seqs)
    finally:
        await client.close()
        await conn.ensure_closed()


Runs = dict[str, list[float]]
"""Events/s of each run, by relay."""


async def measure(
    kinds: Sequence[str], names: dict[str, str], events: int, repeat: int, workers: list[int]
) -> dict[str, Runs]:
    """Every relay ``repeat`` times on each database, the databases taking turns relay by
    relay; prints each round as it ends."""
    relays = ["baseline", *(f"router serve --workers {count}" for count in workers)]
    runs: dict[str, Runs] = {kind: {relay: [] for relay in relays} for kind in kinds}
    for round_ in range(repeat):
        for relay, count in zip(relays, [0, *workers], strict=True):
            for kind in kinds:
                rate = await (
                    run_router(kind, events, count) if count else run_baseline(kind, events)
                )
                runs[kind][relay].append(rate)
        print(
            f"round {round_ + 1}/{repeat}: "
            + "; ".join(
                (f"{names[kind]}: " if len(kinds) > 1 else "")
                + ", ".join(f"{relay} {values[-1]:,.0f}/s" for relay, values in runs[kind].items())
                for kind in kinds
            ),
            flush=True,
        )
    return runs


def summarise(runs: Runs) -> dict[str, Any]:
    """Each relay's median, its runs and its ratio to the baseline."""
    baseline = median(runs["baseline"])
    return {
        relay: {
            "events_per_second": round(median(values)),
            "runs": [round(v) for v in values],
            "ratio_to_baseline": round(median(values) / baseline, 3),
        }
        for relay, values in runs.items()
    }


def print_drain_table(
    events: int, repeat: int, names: dict[str, str], figures: dict[str, dict[str, Any]]
) -> None:
    """One row per relay; with two databases, side by side and MariaDB's rate over
    PostgreSQL's."""
    header = ["relay"]
    for kind in figures:
        named = f"{names[kind]} " if len(figures) > 1 else ""
        header += [f"{named}events/s", "vs baseline", "runs"]
    if len(figures) > 1:
        header.append(f"{names['mysql']} / {names['postgresql']}")
    rows = []
    for relay in next(iter(figures.values())):
        row = [relay]
        for kind_figures in figures.values():
            figure = kind_figures[relay]
            row += [
                f"{figure['events_per_second']:,}",
                f"{figure['ratio_to_baseline']:.2f}x",
                " ".join(f"{v:,}" for v in figure["runs"]),
            ]
        if len(figures) > 1:
            row.append(f"{across(figures, relay):.2f}x")
        rows.append(row)
    print_table(
        f"drain: {events:,} events from {' and '.join(names[k] for k in figures)} into "
        f"JetStream (median of {repeat})",
        header,
        rows,
    )


def across(figures: dict[str, dict[str, Any]], relay: str) -> float:
    """MariaDB's median rate of a relay over PostgreSQL's."""
    rates = {kind: figures[kind][relay]["events_per_second"] for kind in ("mysql", "postgresql")}
    return float(rates["mysql"] / rates["postgresql"])


async def compare(
    kinds: Sequence[str], events: int, rounds: int, workers: list[int]
) -> tuple[dict[str, Any], dict[str, Any], float | None]:
    """Measure, print the table; the figures, the parameters this adds, and PostgreSQL's
    baseline median (events/s) when it was measured."""
    parameters: dict[str, Any] = {"method": "in-process baseline, memory stream, first to last"}
    names = {"postgresql": "PostgreSQL"}
    if "mysql" in kinds:
        parameters["mysql_server"] = await _mysql.server_settings()
        names["mysql"] = _mysql.server_name(parameters["mysql_server"]["version"])
    runs = await measure(kinds, names, events, rounds, workers)
    figures = {kind: summarise(runs[kind]) for kind in kinds}
    print_drain_table(events, rounds, names, figures)
    baseline = median(runs["postgresql"]["baseline"]) if "postgresql" in kinds else None
    if len(kinds) == 1:
        return dict(figures[kinds[0]]), parameters, baseline
    ratios = {relay: round(across(figures, relay), 3) for relay in runs["mysql"]}
    return {**figures, "mysql_vs_postgresql": ratios}, parameters, baseline
