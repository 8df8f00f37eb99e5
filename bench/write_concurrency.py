"""write_concurrency: what stage() costs the application at K concurrent writers (#39).

    python -m bench.write_concurrency [--clients psycopg,asyncpg,mysql] [--writers 1,4,8,16,32]
                                      [--seconds 5] [--rounds 3] [--relay]
                                      [--idle-wakeups] [--gaps 1,3,10] [--output ...]

K writers commit flat out for ``--seconds`` per point, each transaction one INSERT into a
small ``orders`` table and one event for one target, keyed by its order id, then COMMIT
(``bench._writers``): ``psycopg`` threads with a connection each (``SyncOutbox.stage``),
``asyncpg`` tasks holding a connection each of a pool of K (``Outbox.stage`` with the raw
connection), ``mysql`` threads on SQLAlchemy + PyMySQL on MariaDB. The modes: ``hand``, the
strongest hand-written outbox for the client (its own plain table, one prepared INSERT);
``hand+notify`` (PostgreSQL), the same with a ``pg_notify`` folded into the INSERT; and
``stage``, the library on ``router_outbox`` as ``router init-db`` makes it.

Interleaved rounds: in each round, for each K, every client runs every mode one after
another (the order rotated per round), each point on new connections after one uncounted
transaction each. The figures: commits/s per (client, K, mode), median and range of the
rounds, and the ratios stage/hand and (hand+notify)/hand, each the median of the rounds' own.

``--relay`` runs ``router serve`` on the same databases during the measurement, its target
paused first (``router pause events``), so the relay claims nothing and publishes nothing but
keeps its wake-up (the LISTEN the NOTIFY wakes) active. Off by default.

``--idle-wakeups`` measures instead, per database (PostgreSQL, MariaDB, SQLite, each with a
``router serve`` of its own delivering to a fresh NATS stream), commit to arrival at a NATS
subscriber of single events staged after the relay sat idle ``--gaps`` seconds
(``bench._idle_wakeups``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import uvloop
import yaml

from bench import _mysql
from bench._common import (
    RouterProcess,
    Stream,
    fresh_stream,
    median,
    nats_broker,
    print_table,
    write_results,
)
from bench._idle_wakeups import idle_wakeups, report_wakeups
from bench._writers import CLIENTS, KIND, TARGET, Client, create_tables, make_client
from router.config import RouterConfig

Rounds = dict[tuple[str, int, str], list[float]]
"""Commits/s of each round, by (client, K, mode)."""


def numbers(text: str, kind: type[Any] = int) -> list[Any]:
    """``1,4,8`` as a list."""
    return [kind(part) for part in text.split(",") if part]


def config(urls: dict[str, Any], stream: Stream) -> dict[str, Any]:
    """One config for the writers and ``router serve``: the databases by kind (a URL, or a
    database's settings), one target."""
    return {
        "service": "bench",
        "databases": urls,
        "brokers": {TARGET: nats_broker(stream, internal=True)},
        "http": {"enabled": False},
    }


def entered(runner: asyncio.Runner, stack: contextlib.ExitStack, manager: Any) -> Any:
    """An async context manager entered on ``runner``, left when ``stack`` closes (the
    writers run outside the loop: asyncpg's points start loops of their own)."""
    value = runner.run(manager.__aenter__())
    stack.push(lambda *exc: runner.run(manager.__aexit__(*exc)))
    return value


@contextlib.contextmanager
def paused_relay(settings: dict[str, Any]) -> Any:
    """``router serve`` on the databases, its target paused before it starts."""
    with tempfile.TemporaryDirectory(prefix="router-bench-") as folder:
        path = Path(folder) / "config.yaml"
        path.write_text(yaml.safe_dump(settings))
        router = str(Path(sys.executable).with_name("router"))
        subprocess.run([router, "--config", str(path), "pause", TARGET], check=True)
        with RouterProcess(settings) as relay:
            yield relay


def measure(clients: list[Client], args: argparse.Namespace) -> Rounds:
    """Every round: per K, per client, every mode in turn (rotated by the round)."""
    rounds: Rounds = {}
    for round_ in range(args.rounds):
        for writers in args.writers:
            for client in clients:
                modes = client.modes[round_ % len(client.modes) :]
                modes += client.modes[: round_ % len(client.modes)]
                for mode in modes:
                    rate = client.point(mode, writers, args.seconds)
                    rounds.setdefault((client.name, writers, mode), []).append(rate)
                    print(
                        f"  round {round_ + 1}/{args.rounds} K={writers} {client.name} "
                        f"{mode}: {rate:,.0f} commits/s",
                        flush=True,
                    )
    return rounds


def spread(values: list[float], digits: int = 0) -> dict[str, Any]:
    """Median, lowest, highest, and every run in round order."""
    return {
        "median": round(median(values), digits or None),
        "min": round(min(values), digits or None),
        "max": round(max(values), digits or None),
        "runs": [round(v, digits or None) for v in values],
    }


def summarise(clients: list[Client], args: argparse.Namespace, rounds: Rounds) -> dict[str, Any]:
    """Per client, per K: each mode's commits/s and the ratios to ``hand``, round by round."""
    figures: dict[str, Any] = {}
    for client in clients:
        for writers in args.writers:
            runs = {mode: rounds[(client.name, writers, mode)] for mode in client.modes}
            point: dict[str, Any] = {mode: spread(r) for mode, r in runs.items()}
            for mode in client.modes[1:]:
                ratios = [m / h for m, h in zip(runs[mode], runs["hand"], strict=True)]
                point[f"{mode}/hand"] = spread(ratios, 3)
            figures.setdefault(client.name, {})[str(writers)] = point
    return figures


def report(figures: dict[str, Any], args: argparse.Namespace) -> None:
    """The table: commits/s per mode, the ratios to hand."""

    def cell(f: dict[str, Any] | None, form: str) -> str:
        if f is None:
            return "-"
        return f"{f['median']:{form}} ({f['min']:{form}}-{f['max']:{form}})"

    rows = [
        [client, k]
        + [cell(point.get(m), ",.0f") for m in ("hand", "hand+notify", "stage")]
        + [cell(point.get(r), ".2f") for r in ("stage/hand", "hand+notify/hand")]
        for client, points in figures.items()
        for k, point in points.items()
    ]
    relay = ", router serve running (target paused)" if args.relay else ""
    print_table(
        f"write_concurrency: commits/s, K writers flat out for {args.seconds:g} s, median "
        f"(lowest-highest) of {args.rounds} interleaved rounds{relay}",
        ["client", "K", "hand", "hand+notify", "stage", "stage/hand", "notify/hand"],
        rows,
    )
    print(
        "  each transaction: one orders row + one event, own stream key; hand: a plain outbox"
        "\n  table, one prepared INSERT; hand+notify: the same with pg_notify folded in."
    )


def writes(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The write-concurrency measurement; its parameters and figures."""
    kinds = sorted({KIND[name] for name in args.clients}, reverse=True)  # postgresql first
    with asyncio.Runner() as runner, contextlib.ExitStack() as stack:
        urls = {
            kind: entered(runner, stack, _mysql.fresh_database(kind, "write_conc"))
            for kind in kinds
        }
        for kind, url in urls.items():
            create_tables(kind, url)
        stream = entered(runner, stack, fresh_stream("write_conc"))
        settings = config(urls, stream)
        parsed = RouterConfig.model_validate(settings)
        clients = [make_client(name, urls[KIND[name]], parsed) for name in args.clients]
        if args.relay:
            stack.enter_context(paused_relay(settings))
        rounds = measure(clients, args)
        mariadb = runner.run(_mysql.server_settings()) if "mysql" in kinds else None
    parameters = {
        "clients": args.clients,
        "writers": args.writers,
        "seconds": args.seconds,
        "rounds": args.rounds,
        "relay": args.relay,
        "mariadb": mariadb,
    }
    return parameters, summarise(clients, args, rounds)


def main() -> None:
    """Measure, print, save."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=lambda s: s.split(","), default=list(CLIENTS))
    parser.add_argument("--writers", type=numbers, default=[1, 4, 8, 16, 32])
    parser.add_argument("--seconds", type=float, default=5.0, help="per point")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--relay", action="store_true", help="router serve running, paused")
    parser.add_argument(
        "--idle-wakeups",
        action="store_true",
        help="commit-to-arrival after idle gaps per database, instead",
    )
    parser.add_argument("--gaps", type=lambda s: numbers(s, float), default=[1.0, 3.0, 10.0])
    parser.add_argument("--output", help="bench/results/OUTPUT.json")
    args = parser.parse_args()
    if unknown := set(args.clients) - set(CLIENTS):
        parser.error(f"unknown clients: {', '.join(sorted(unknown))}")
    if args.idle_wakeups:
        parameters = {"gaps": args.gaps, "rounds": args.rounds}
        figures = uvloop.run(idle_wakeups(args.gaps, args.rounds))
        report_wakeups(figures, args.rounds)
        output = args.output or "idle-wakeups"
    else:
        parameters, figures = writes(args)
        report(figures, args)
        output = args.output or "write-concurrency"
    path = write_results(output, parameters, figures)
    print(f"written to {path}")


if __name__ == "__main__":
    main()
