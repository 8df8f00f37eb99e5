"""drain: how fast a backlog in PostgreSQL is drained into NATS JetStream, from process start.

    python -m bench.drain [--events 20000] [--rounds 5] [--workers 1 2]
                          [--storage file|memory|both]
                          [--brokers nats kafka rabbitmq redis servicebus]
                          [--database postgresql|mysql|both] [--output drain]

Every measurement drains a fresh backlog (a fresh database, staged by the real write path)
into a fresh stream of ``--storage`` (default file, as users run JetStream), with a relay
started as a process of its own and timed from exec (see ``bench._drain_runs``):

- ``router serve`` (one process; and ``--workers 2``), with a generated NATS-only config;
- ``python -m bench.baseline``: the strongest relay we could write by hand in a page (uvloop,
  asyncpg, nats-py; claim 500 by primary key with ``SKIP LOCKED``, publish with every ack in
  flight, one UPDATE to mark), the baseline issue #16 describes: its claim leases the rows,
  so it writes each row twice;
- ``python -m bench.baseline --hold`` ("baseline, one write"): the same page holding the
  batch's transaction while it publishes, so it writes each row once, as the router does on
  PostgreSQL. The stronger of the two: the last column compares everything with it.

Rounds interleave them (router, baseline, router --workers 2, baseline, ..., baseline, one
write) after one uncounted warm-up of each on a 2,000-event backlog, so drift on a shared
machine hits them alike. Per relay: events/s from exec to the last message stored, and from
the first message stored to the last; PostgreSQL's CPU per delivered row; the median and
min-max of the runs; each router run's ratio to the baseline run right after it (median,
min-max), and the ratio of the medians.

``--database mysql`` or ``both`` runs instead the earlier side-by-side comparison of the
databases (``bench._drain_databases``). Then the same backlog is drained into every broker of
``--brokers`` (see ``bench._brokers``; NATS on a file stream), once per worker count, timed
from the router's first claim and from its exec to the last row marked published, and
counted at the broker: on PostgreSQL only. Each broker's rate is set against the medians of
the baselines' drains into JetStream above.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Sequence
from typing import Any

from nats.js.api import StorageType

from bench import _mysql
from bench._brokers import KINDS, NOTES, drain_into, harnesses
from bench._common import Stream, median, print_table, write_results
from bench._drain_databases import compare
from bench._drain_runs import (
    BATCH,
    HELD_BASELINE,
    PER_ORDER,
    PER_TRANSACTION,
    compile_bytecode,
    drain,
    stage_backlog,
)

__all__ = ["main", "stage_backlog"]

WARMUP_EVENTS = 2_000
METRICS = ("from_exec", "first_to_last", "pg_cpu_us_per_row")
CPU_METRICS = ("pg_cpu_us_per_row", "relay_cpu_us_per_row", "nats_cpu_us_per_row")
STORAGES = {"file": [StorageType.FILE], "memory": [StorageType.MEMORY]}
STORAGES["both"] = [*STORAGES["file"], *STORAGES["memory"]]
PG_CPU_NOTE = (
    "PostgreSQL CPU: utime + stime of every process named postgres* on the machine (and of its "
    "exited children), from just before exec until the relay has exited and its connections "
    "are gone, over the events; the drain's database is fresh, but anything else the server "
    "did meanwhile is counted too"
)

CPU_NOTE = (
    "relay CPU: the relay's process and every worker it forked (user + system, as the kernel "
    "counts them once reaped; start-up included); NATS CPU: the nats-server process over the "
    "same span; both over the events"
)

WAL_NOTE = (
    "WAL: bytes PostgreSQL wrote to its WAL per event over the same span (server-wide insert "
    "position), full-page images after a checkpoint included"
)

HEADER = ["relay", "exec->last /s", "vs baseline", "first->last /s", "vs baseline"]
HEADER += ["CPU us/row: PG", "relay", "NATS", "WAL B/row", "bytes/msg"]
HEADER += ["vs one write (exec, 1st->last)"]
HELD = "baseline, one write"
BROKER_HEADER = ["broker", "workers", "1st claim /s", "vs baseline", "vs one write"]
BROKER_HEADER += ["exec /s", "vs one write", "arrived", "peer"]

Drains = dict[str, list[dict[str, float]]]
"""Each relay's drains (the figures of ``_drain_runs.drain``), in order."""


def round_order(workers: Sequence[int]) -> list[tuple[str, int]]:
    """One round: each router variant, then the baseline (worker count 0); at the end the
    baseline that writes each row once (``HELD_BASELINE``)."""
    steps = [
        step
        for count in workers
        for step in ((f"router serve --workers {count}", count), ("baseline", 0))
    ]
    return [*steps, (HELD, HELD_BASELINE)]


async def measure(
    storages: Sequence[StorageType], events: int, rounds: int, workers: Sequence[int]
) -> dict[str, Drains]:
    """Warm-ups, then ``rounds`` interleaved rounds; each storage's drains by relay."""
    steps = round_order(workers)
    for storage in storages:
        for count in dict(steps).values():
            await drain(count, storage, min(events, WARMUP_EVENTS))
    runs: dict[str, Drains] = {s.value: {name: [] for name, _ in steps} for s in storages}
    for round_ in range(rounds):
        for storage in storages:
            for name, count in steps:
                runs[storage.value][name].append(await drain(count, storage, events))
        print(
            f"round {round_ + 1}/{rounds}: "
            + "; ".join(
                f"{storage}: "
                + ", ".join(f"{name} {d[-1]['from_exec']:,.0f}/s" for name, d in drains.items())
                for storage, drains in runs.items()
            ),
            flush=True,
        )
    return runs


def spread(values: Sequence[float], digits: int = 0) -> dict[str, Any]:
    """Median, min, max and the runs."""

    def rounded(value: float) -> float:
        return round(value, digits) if digits else round(value)

    return {
        "median": rounded(median(values)),
        "min": rounded(min(values)),
        "max": rounded(max(values)),
        "runs": [rounded(v) for v in values],
    }


def summarise(drains: Drains, workers: Sequence[int]) -> dict[str, Any]:
    """Per relay: each metric's spread, the ratios of its medians to the baseline's and, for
    the router, the spread of its ratio to the baseline run that followed each run."""
    baseline, held = drains["baseline"], drains[HELD]
    figures: dict[str, Any] = {}
    for name, runs in drains.items():
        figure: dict[str, Any] = {
            key: spread([r[key] for r in runs], 1 if key in CPU_METRICS else 0)
            for key in (*METRICS, *CPU_METRICS[1:])
        }
        figure["bytes_per_message"] = round(median([r["bytes_per_message"] for r in runs]), 1)
        figure["wal_bytes_per_row"] = spread([r["wal_bytes_per_row"] for r in runs], 0)
        figure["ratio_to_baseline"] = {
            key: round(median([r[key] for r in runs]) / median([b[key] for b in baseline]), 3)
            for key in METRICS
        }
        figure["ratio_to_one_write_baseline"] = {
            key: round(median([r[key] for r in runs]) / median([b[key] for b in held]), 3)
            for key in METRICS
        }
        if name.startswith("router"):
            # A round runs router(w0), baseline, router(w1), baseline, ...: the baseline runs
            # that followed this router's are every len(workers)-th from its place.
            place = [f"router serve --workers {count}" for count in workers].index(name)
            after = baseline[place :: len(workers)]
            figure["paired_ratio"] = {
                key: spread([r[key] / b[key] for r, b in zip(runs, after, strict=True)], 3)
                for key in METRICS[:2]
            }
        figures[name] = figure
    return figures


def cell(figure: dict[str, Any], digits: int = 0) -> str:
    """``median (min-max)``."""
    low, middle, high = (f"{figure[k]:,.{digits}f}" for k in ("min", "median", "max"))
    return f"{middle} ({low}-{high})"


def ratio(figure: dict[str, Any], key: str) -> str:
    """Each run over the baseline run right after it: median (min-max)."""
    if "paired_ratio" not in figure:
        return "1.00x"
    paired = figure["paired_ratio"][key]
    return f"{paired['median']:.2f}x ({paired['min']:.2f}-{paired['max']:.2f})"


def print_tables(events: int, rounds: int, figures: dict[str, Any]) -> None:
    """One table per storage."""
    for storage, relays in figures.items():
        print_table(
            f"drain: {events:,} events, PostgreSQL -> JetStream ({storage} storage); "
            f"median (min-max) of {rounds} rounds",
            HEADER,
            [
                (
                    name,
                    cell(f["from_exec"]),
                    ratio(f, "from_exec"),
                    cell(f["first_to_last"]),
                    ratio(f, "first_to_last"),
                    *(cell(f[key], 1) for key in CPU_METRICS),
                    cell(f["wal_bytes_per_row"]),
                    f"{f['bytes_per_message']:,.0f}",
                    "{from_exec:.2f}x, {first_to_last:.2f}x".format(
                        **f["ratio_to_one_write_baseline"]
                    ),
                )
                for name, f in relays.items()
            ],
        )
    print(
        "exec->last: from the bench's clock read just before the relay's process is spawned to "
        "the last message stored (JetStream's timestamp); vs baseline: each router run over the "
        "baseline run right after it, median (min-max); the JSON also has the medians' ratio; "
        "vs one write: ratio of the medians to the baseline that writes each row once"
    )
    print(PG_CPU_NOTE)
    print(CPU_NOTE)
    print(WAL_NOTE)


Baselines = dict[str, float]
"""The per-broker drains' references, events/s by name (``BASELINES``)."""

BASELINES = {
    "ratio_to_baseline": "the leasing relay, first->last",
    "ratio_to_one_write": "the one-write relay, first->last",
    "from_exec_ratio_to_one_write": "the one-write relay, from exec (the router's from exec)",
}


def per_broker_baselines(drains: Drains) -> Baselines:
    """The medians the per-broker drains are set against, from one storage's drains.

    From the first claim against first->last: the closest the baselines' figures come (they
    leave out the baseline's first claim and connect, so they favour the baseline a little);
    from exec against from exec, like for like."""
    held = drains[HELD]
    return {
        "ratio_to_baseline": median([d["first_to_last"] for d in drains["baseline"]]),
        "ratio_to_one_write": median([d["first_to_last"] for d in held]),
        "from_exec_ratio_to_one_write": median([d["from_exec"] for d in held]),
    }


def broker_ratios(result: dict[str, Any], baselines: Baselines) -> dict[str, float]:
    """One drain's ratios to each baseline it has."""
    rates = {
        "ratio_to_baseline": result["events_per_second"],
        "ratio_to_one_write": result["events_per_second"],
        "from_exec_ratio_to_one_write": result["from_exec_per_second"],
    }
    return {key: round(rates[key] / rate, 3) for key, rate in baselines.items()}


async def drain_per_broker(
    events: int, workers: list[int], kinds: list[str], baselines: Baselines
) -> dict[str, Any]:
    """Drain the backlog into each broker kind; print a table; return the figures."""
    if not kinds:
        return {}

    async def stage(url: str, brokers: dict[str, Any], count: int) -> None:
        await stage_backlog(url, Stream("unused", "unused"), count, brokers)

    def ratio(result: dict[str, Any], key: str) -> str:
        return f"{result[key]:.2f}x" if key in result else "-"

    figures: dict[str, Any] = {}
    rows = []
    async with harnesses(kinds) as makers:
        for kind, make in makers.items():
            figures[kind] = {"broker": NOTES[kind]}
            for count in workers:
                result = await drain_into(make(), events, count, stage)
                result.update(broker_ratios(result, baselines))
                figures[kind][f"workers {count}"] = result
                rows.append(
                    (
                        kind,
                        count,
                        f"{result['events_per_second']:,}",
                        ratio(result, "ratio_to_baseline"),
                        ratio(result, "ratio_to_one_write"),
                        f"{result['from_exec_per_second']:,}",
                        ratio(result, "from_exec_ratio_to_one_write"),
                        f"{result['arrived']:,}",
                        NOTES[kind],
                    )
                )
                print(f"{kind} --workers {count}: {result['events_per_second']:,}/s", flush=True)
    print_table(
        f"drain per broker: {events:,} events to the last row marked published (database "
        "clock), from the first claim (connecting to the broker included) and from exec",
        BROKER_HEADER,
        rows,
    )
    print(
        "  vs baseline / vs one write: over the median first->last of the leasing / one-write "
        "relay above;\n  from exec: over the one-write relay's median from exec."
    )
    return figures


def parse() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--rounds", "--repeat", type=int, default=5)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--storage", choices=list(STORAGES), default="file")
    parser.add_argument("--brokers", nargs="*", choices=KINDS, default=list(KINDS))
    _mysql.add_database_option(parser)
    parser.add_argument("--output", default="drain", help="bench/results/OUTPUT.json")
    return parser.parse_args()


async def main() -> None:
    """Measure the relays, then the brokers; print and save."""
    args = parse()
    kinds = _mysql.chosen(args.database)
    compile_bytecode()
    parameters: dict[str, Any] = {
        "events": args.events,
        "rounds": args.rounds,
        "warmup_events": min(args.events, WARMUP_EVENTS),
        "workers": args.workers,
        "events_per_order": PER_ORDER,
        "events_per_transaction": PER_TRANSACTION,
        "batch_size": BATCH,
        "database": args.database,
        "baseline": f"python -m bench.baseline --batch {BATCH} (uvloop, asyncpg, nats-py)",
    }
    load_before = os.getloadavg()
    if args.database == "postgresql":
        storages = STORAGES[args.storage]
        parameters["storage"] = [s.value for s in storages]
        runs = await measure(storages, args.events, args.rounds, args.workers)
        results: dict[str, Any] = {s: summarise(d, args.workers) for s, d in runs.items()}
        print_tables(args.events, args.rounds, results)
        results["pg_cpu_note"] = PG_CPU_NOTE
        baselines = per_broker_baselines(runs[storages[-1].value])
        results["per_broker_baseline"] = {
            key: f"{BASELINES[key]}, {storages[-1].value} storage" for key in baselines
        }
    else:
        results, extra, baseline = await compare(kinds, args.events, args.rounds, args.workers)
        parameters.update(extra)
        # The in-process baseline of that method (memory stream), first->last.
        baselines = {} if baseline is None else {"ratio_to_baseline": baseline}
    per_broker: dict[str, Any] = {}
    if baselines:
        per_broker = await drain_per_broker(args.events, args.workers, args.brokers, baselines)
    elif args.brokers:
        print("drain per broker: on PostgreSQL only (--database postgresql or both)")
    # The machine is shared: the load says how much of the spread was other people's work.
    load = {"before": load_before, "after": os.getloadavg(), "cpus": os.cpu_count()}
    print(f"load average before {load['before']}, after {load['after']}, {load['cpus']} CPUs")
    figures = {**results, "per_broker": per_broker, "load_average": load}
    path = write_results(args.output, parameters, figures)
    print(f"written to {path.relative_to(path.parents[2])}")


if __name__ == "__main__":
    asyncio.run(main())
