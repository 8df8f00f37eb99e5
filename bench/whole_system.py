"""whole_system: writers and a relay on one machine, the router against a hand-written outbox.

    python -m bench.whole_system [--writers 4,16] [--seconds 10] [--rounds 3]
                                 [--wakeup auto|log|notify|poll] [--linger 0,0.002]
                                 [--output whole-system]

Each point: a fresh PostgreSQL database and a fresh file-backed JetStream stream; a relay
started and given two seconds; then K psycopg threads commit flat out for ``--seconds``, each
transaction one ``orders`` row and one event (``bench._writers``), while the relay drains:

- ``router``: ``SyncOutbox.stage()`` into ``router_outbox``, ``router serve`` draining it
  (its wake-up active: ``--wakeup``, the database's ``wakeup:``, ``auto`` by default, which on
  the shared server, ``wal_level=replica``, is LISTEN and the wake locks);
- ``hand``: the hand outbox of ``bench._writers`` (one prepared INSERT), drained by the
  strongest relay we could write for it by hand (``bench._hand_relay``: uvloop, asyncpg,
  nats-py, batches of 500 locked in order, every ack in flight, polling every 10 ms when
  empty);
- ``router linger N ms``, with ``--linger``: the router with ``outbox.linger`` at N ms, one
  system for each value (0 is ``router``).

The figures, per system and K: the writers' commits/s while the relay runs; the rate the
stream received the events (committed events over the time from the first stored message to
the last, JetStream's own timestamps); and the tail, from the writers' last commit to the last
message stored (how far behind the relay was when the writers stopped). Interleaved rounds:
in each round, per K, both systems, the order rotated; median and range of the rounds.
Everything shares the machine's two cores: the relay's work is part of the cost here.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from typing import Any

import asyncpg
from nats.js.api import StorageType

from bench import _mysql
from bench._common import (
    NATS_URL,
    RouterProcess,
    Stream,
    fresh_stream,
    print_table,
    wait_for_count,
    write_results,
)
from bench._writers import create_tables, make_client
from bench.write_concurrency import config, numbers, spread
from router.config import RouterConfig

HAND = "hand"


def system_name(linger: float) -> str:
    """The router's name in the figures with ``outbox.linger`` at ``linger`` seconds."""
    return "router" if linger == 0 else f"router linger {linger * 1000:g} ms"


def systems(lingers: list[float]) -> list[tuple[str, float]]:
    """Every system measured, with its linger (the hand relay's: 0, unused)."""
    return [(system_name(linger), linger) for linger in lingers] + [(HAND, 0.0)]


class HandRelay:
    """``bench._hand_relay`` as a subprocess, stopped with SIGTERM."""

    def __init__(self, url: str, stream: Stream) -> None:
        command = [sys.executable, "-m", "bench._hand_relay", "--dsn", url, "--nats", NATS_URL]
        self.process = subprocess.Popen([*command, "--subject", stream.subject])

    def __enter__(self) -> HandRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


async def point(
    system: str, writers: int, seconds: float, wakeup: str, linger: float = 0.0
) -> dict[str, float]:
    """One system at K writers: commits/s, delivered/s, tail seconds."""
    hand = system == HAND
    async with (
        _mysql.fresh_database("postgresql", "whole") as url,
        fresh_stream("whole", StorageType.FILE) as stream,
    ):
        create_tables("postgresql", url)
        settings = config({"postgresql": {"url": url, "wakeup": wakeup}}, stream)
        settings["outbox"] = {"linger": linger}
        client = make_client("psycopg", url, RouterConfig.model_validate(settings))
        relay: Any = HandRelay(url, stream) if hand else RouterProcess(settings)
        with relay:
            await asyncio.sleep(2.0)
            mode = "hand" if hand else "stage"
            rate = await asyncio.to_thread(client.point, mode, writers, seconds)
            stopped = time.time()
            conn = await asyncpg.connect(url)
            try:
                table = "hand_outbox" if hand else "router_outbox"
                total = int(await conn.fetchval(f"SELECT count(*) FROM {table}"))
            finally:
                await conn.close()
            first, last = await wait_for_count(stream, total, timeout=300)
    return {
        "commits_per_s": rate,
        "delivered_per_s": total / max(last - first, 1e-6),
        "tail_s": max(last - stopped, 0.0),
    }


async def measure(args: argparse.Namespace) -> dict[tuple[str, int], list[dict[str, float]]]:
    """Every round: per K, every system in turn (rotated by the round)."""
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    measured = systems(args.linger)
    for round_ in range(args.rounds):
        for writers in args.writers:
            shift = round_ % len(measured)
            for system, linger in measured[shift:] + measured[:shift]:
                figures = await point(system, writers, args.seconds, args.wakeup, linger)
                runs.setdefault((system, writers), []).append(figures)
                print(
                    f"  round {round_ + 1}/{args.rounds} K={writers} {system}: "
                    f"{figures['commits_per_s']:,.0f} commits/s, "
                    f"{figures['delivered_per_s']:,.0f} delivered/s, "
                    f"tail {figures['tail_s']:.2f} s",
                    flush=True,
                )
    return runs


def summarise(
    runs: dict[tuple[str, int], list[dict[str, float]]], args: argparse.Namespace
) -> dict[str, Any]:
    """Per K: each system's figures (median, range, runs) and each router's over the hand
    relay's, per round."""
    figures: dict[str, Any] = {}
    for writers in args.writers:
        point_: dict[str, Any] = {}
        for system, _ in systems(args.linger):
            rounds = runs[(system, writers)]
            point_[system] = {
                name: spread([r[name] for r in rounds], 2 if name == "tail_s" else 0)
                for name in ("commits_per_s", "delivered_per_s", "tail_s")
            }
        hand = runs[(HAND, writers)]
        for router in (system_name(linger) for linger in args.linger):
            for name in ("commits_per_s", "delivered_per_s"):
                ratios = [
                    r[name] / h[name] for r, h in zip(runs[(router, writers)], hand, strict=True)
                ]
                point_[f"{router}/hand {name}"] = spread(ratios, 3)
        figures[str(writers)] = point_
    return figures


def report(figures: dict[str, Any], args: argparse.Namespace) -> None:
    """The table."""

    def cell(f: dict[str, Any], form: str) -> str:
        return f"{f['median']:{form}} ({f['min']:{form}}-{f['max']:{form}})"

    rows = []
    for k, point_ in figures.items():
        for system, _ in systems(args.linger):
            f = point_[system]
            rows.append(
                [
                    k,
                    system,
                    cell(f["commits_per_s"], ",.0f"),
                    cell(f["delivered_per_s"], ",.0f"),
                    cell(f["tail_s"], ".2f"),
                ]
            )
        for router in (system_name(linger) for linger in args.linger):
            rows.append(
                [
                    k,
                    f"{router}/hand",
                    cell(point_[f"{router}/hand commits_per_s"], ".2f"),
                    cell(point_[f"{router}/hand delivered_per_s"], ".2f"),
                    "",
                ]
            )
    print_table(
        f"whole_system: K psycopg writers for {args.seconds:g} s with a relay draining into a "
        f"file-backed JetStream stream, median (lowest-highest) of {args.rounds} rounds",
        ["K", "system", "commits/s", "delivered/s", "tail s"],
        rows,
    )


def main() -> None:
    """Measure, print, save."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writers", type=numbers, default=[4, 16])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--wakeup", default="auto", choices=["auto", "log", "notify", "poll"])
    parser.add_argument(
        "--linger",
        type=lambda text: numbers(text, float),
        default=[0.0],
        help="outbox.linger values, in seconds: 0,0.002",
    )
    parser.add_argument("--output", default="whole-system", help="bench/results/OUTPUT.json")
    args = parser.parse_args()
    runs = asyncio.run(measure(args))
    figures = summarise(runs, args)
    report(figures, args)
    parameters = {"writers": args.writers, "seconds": args.seconds, "rounds": args.rounds}
    parameters |= {"wakeup": args.wakeup, "lingers": args.linger}
    path = write_results(args.output, parameters, figures)
    print(f"written to {path}")


if __name__ == "__main__":
    main()
