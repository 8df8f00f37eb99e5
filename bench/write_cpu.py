"""write_cpu: the CPU one transaction costs the writer and the database, stage() against the
hand outbox (#39).

    python -m bench.write_cpu [--clients psycopg,asyncpg,mysql] [--transactions 3000]
                              [--rounds 4] [--relay] [--wakeup auto|log|notify|poll]
                              [--output write-cpu]

Where writers and the database share a machine's cores (this one has 2), commits per second
are bound by CPU from a few writers on, and stage()'s rate against the hand outbox's tends to
the inverse ratio of what a transaction costs both sides together. ``bench.write_concurrency``
measures the rates, which move by a fifth between rounds on this disk; CPU time per
transaction moves by a few per cent, so it shows cuts of a few microseconds the rates hide,
and says on which side the difference lies.

One connection runs ``--transactions`` transactions of a mode (``bench._writers``: the orders
row and the outbox row, then COMMIT), after 50 uncounted ones. The writer's CPU is this
process's; the database's is the user and system time of its server processes on this
machine (``/proc``), read before and after: PostgreSQL's processes (the connection's backend,
the WAL writer, and with ``--relay`` the relay's sessions and the walsender that decodes the
log for its wake-up), or MariaDB's one process. Modes alternate, the order turned each round;
per client and mode the median and range in microseconds a transaction, and ``bound``, the
hand outbox's total over stage()'s: the stage/hand rate the machine tends to when CPU bounds
it.

``--relay``: ``router serve`` running with its target paused (as ``bench.write_concurrency
--relay``), so its wake-up's own work is counted, on the server and in a ``relay`` column of
its own (the ``router serve`` process: the log follower reading every commit, say), which
``bound`` counts too, as it shares the cores; ``--wakeup`` sets the PostgreSQL database's
``wakeup:`` (the writers' and the relay's). Only a database on this
machine can be measured (PostgreSQL from ``BENCH_PG_ADMIN``, MariaDB from ``bench._mysql``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import asyncpg
import uvloop

from bench import _mysql
from bench._common import fresh_stream, print_table, write_results
from bench._drain_runs import CLK_TCK, cpu_ticks
from bench._writers import (
    CLIENTS,
    KIND,
    AsyncpgClient,
    Client,
    SyncClient,
    create_tables,
    make_client,
)
from bench.write_concurrency import config, entered, paused_relay, spread
from router.config import RouterConfig

MODES = ("hand", "stage")
SIDES = ("writer", "database", "relay")
WARM = 50  # uncounted transactions first: the connection's and the library's first calls
# Process names (prefixes) whose CPU is read from /proc (``bench._drain_runs.cpu_ticks``, which
# takes in the time of exited children: PostgreSQL's backends and workers that end during a
# run sit in the postmaster's).
_SERVERS = {"postgresql": ("postgres",), "mysql": ("mariadbd", "mysqld")}
_RELAY = ("router",)  # router serve
RELAY_START = 2.0
"""Seconds ``router serve`` is given to start before the first round."""


def seconds(names: tuple[str, ...]) -> float:
    """CPU seconds of every process whose name starts with one of ``names``."""
    return sum(cpu_ticks(name) for name in names) / CLK_TCK


@contextlib.contextmanager
def counted(kind: str, relay: bool, spent: dict[str, float]) -> Iterator[None]:
    """Fill ``spent`` with the writer's, the database's and (``relay``) router serve's CPU
    seconds of the block."""
    sides = {"database": _SERVERS[kind], **({"relay": _RELAY} if relay else {})}
    before = {side: seconds(names) for side, names in sides.items()}
    writer = time.process_time()
    yield
    spent["writer"] = time.process_time() - writer
    for side, names in sides.items():
        spent[side] = seconds(names) - before[side]


def sync_run(
    client: SyncClient, mode: str, count: int, first: int, relay: bool
) -> dict[str, float]:
    transaction = client.transaction(mode)
    (conn,), close = client.connect(1)
    spent: dict[str, float] = {}
    try:
        for n in range(first, first + WARM):
            transaction(conn, n)
        with counted(client.kind, relay, spent):
            for n in range(first + WARM, first + WARM + count):
                transaction(conn, n)
    finally:
        close()
    return spent


async def _asyncpg_run(
    client: AsyncpgClient, mode: str, count: int, first: int, relay: bool
) -> dict[str, float]:
    transaction = client.transaction(mode)
    conn = await asyncpg.connect(client.url)
    spent: dict[str, float] = {}
    try:
        for n in range(first, first + WARM):
            await transaction(conn, n)
        with counted(client.kind, relay, spent):
            for n in range(first + WARM, first + WARM + count):
                await transaction(conn, n)
    finally:
        await conn.close()
    return spent


def one_run(client: Client, mode: str, count: int, first: int, relay: bool) -> dict[str, float]:
    """Seconds of CPU, the writer's, the database's and the relay's, of ``count``
    transactions."""
    if isinstance(client, AsyncpgClient):
        return uvloop.run(_asyncpg_run(client, mode, count, first, relay))
    assert isinstance(client, SyncClient)
    return sync_run(client, mode, count, first, relay)


Runs = dict[tuple[str, str, str], list[float]]
"""Microseconds a transaction of each round, by (client, mode, side)."""


def measure(clients: list[Client], count: int, rounds: int, relay: bool) -> Runs:
    runs: Runs = {}
    first = 1
    for round_ in range(rounds):
        for client in clients:
            for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
                spent = one_run(client, mode, count, first, relay)
                first += WARM + count
                for side, seconds in spent.items():
                    runs.setdefault((client.name, mode, side), []).append(seconds / count * 1e6)
                line = ", ".join(f"{side} {s / count * 1e6:.0f} us" for side, s in spent.items())
                print(f"  round {round_ + 1}/{rounds} {client.name} {mode}: {line}", flush=True)
    return runs


def summarise(clients: list[Client], runs: Runs) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for client in clients:
        per: dict[str, Any] = {}
        totals: dict[str, list[float]] = {}
        for mode in MODES:
            sides = {
                side: found
                for side in SIDES
                if (found := runs.get((client.name, mode, side))) is not None
            }
            totals[mode] = [sum(parts) for parts in zip(*sides.values(), strict=True)]
            per[mode] = {side: spread(v, 1) for side, v in sides.items()}
            per[mode]["total"] = spread(totals[mode], 1)
        per["bound"] = spread(
            [h / s for h, s in zip(totals["hand"], totals["stage"], strict=True)], 3
        )
        figures[client.name] = per
    return figures


def report(figures: dict[str, Any], args: argparse.Namespace) -> None:
    def cell(f: dict[str, Any], form: str = ".0f") -> str:
        return f"{f['median']:{form}} ({f['min']:{form}}-{f['max']:{form}})"

    rows = []
    sides = SIDES if args.relay else SIDES[:2]
    for name, per in figures.items():
        for mode in MODES:
            m = per[mode]
            rows.append([name, mode, *(cell(m[side]) for side in sides), cell(m["total"])])
        rows.append([name, "hand/stage", *([""] * len(sides)), cell(per["bound"], ".3f")])
    relay = f", router serve running (target paused, wakeup {args.wakeup})" if args.relay else ""
    title = (
        f"CPU a transaction, microseconds: median (lowest-highest) of {args.rounds} interleaved"
        f" rounds of {args.transactions:,} transactions on one connection{relay}"
    )
    print_table(title, ["client", "mode", *sides, "total"], rows)


def main() -> None:
    """Measure, print, save."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=lambda s: s.split(","), default=list(CLIENTS))
    parser.add_argument("--transactions", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--relay", action="store_true", help="router serve running, paused")
    parser.add_argument("--wakeup", default="auto", choices=["auto", "log", "notify", "poll"])
    parser.add_argument("--output", default="write-cpu", help="bench/results/OUTPUT.json")
    args = parser.parse_args()
    if unknown := set(args.clients) - set(CLIENTS):
        parser.error(f"unknown clients: {', '.join(sorted(unknown))}")
    kinds = sorted({KIND[name] for name in args.clients}, reverse=True)
    with asyncio.Runner() as runner, contextlib.ExitStack() as stack:
        urls = {
            kind: entered(runner, stack, _mysql.fresh_database(kind, "write_cpu")) for kind in kinds
        }
        for kind, url in urls.items():
            create_tables(kind, url)
        stream = entered(runner, stack, fresh_stream("write_cpu"))
        settings = config(urls, stream)
        if "postgresql" in urls:
            database = {"url": urls["postgresql"], "wakeup": args.wakeup}
            settings["databases"] = {**urls, "postgresql": database}
        parsed = RouterConfig.model_validate(settings)
        clients = [make_client(name, urls[KIND[name]], parsed) for name in args.clients]
        if args.relay:
            stack.enter_context(paused_relay(settings))
            time.sleep(RELAY_START)  # its start-up (connections, streams) in no round
        runs = measure(clients, args.transactions, args.rounds, args.relay)
    figures = summarise(clients, runs)
    report(figures, args)
    parameters = {
        "clients": args.clients,
        "transactions": args.transactions,
        "rounds": args.rounds,
        "relay": args.relay,
        "wakeup": args.wakeup,
        "warm": WARM,
    }
    print(f"written to {write_results(args.output, parameters, figures)}")


if __name__ == "__main__":
    main()
