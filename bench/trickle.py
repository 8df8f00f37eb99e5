"""trickle: does commit-to-arrival latency creep while a fresh router follows a steady trickle?

    python -m bench.trickle [--rate 800] [--seconds 60] [--runs 3] [--autovacuum off|on|both]
                            [--vacuum-after-rows 5000] [--server-autovacuum]
                            [--producer-async]

The reported defect: one application connection commits one event per transaction (each its
own stream key) at a steady 800/s while a freshly started ``router serve`` delivers to a
file-storage JetStream stream; in some runs delivery fell behind the write rate after 5-10 s,
in others p99 crept up from ~10 ms to ~50 ms over 15 s.

Each run: a fresh database and a fresh file stream; ``router serve`` (one process) spawned
the moment the producer starts; the producer commits on absolute deadlines and notes when
each COMMIT returned; a NATS subscriber notes when each message arrived (``Nats-Msg-Id``); a
separate connection samples the outbox's ``n_dead_tup``/``n_live_tup``, vacuums so far and open
rows every second. Reported per second of the run (by commit time) and over the whole run,
with the drift: p99 of the last 10 s minus p99 of the first 10 s.

``--autovacuum on`` needs autovacuum on in the server: the per-table switch does nothing while
the global one is off. ``--server-autovacuum`` switches it on server-wide for those runs
(ALTER SYSTEM, reload, and reset after each run); without it the router vacuums the outbox
itself every ``--vacuum-after-rows`` marked rows instead, and the output says so. ``off``
switches it off for the table, so it holds on any server; the router's own vacuum keeps its
default there.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import uvloop

from bench._common import ADMIN_DSN, print_table, write_results
from bench._trickle_run import Sample, Trace, Variant, run

OFF = Variant(
    "autovacuum off",
    table_autovacuum=False,
    vacuum_after_rows=None,
    note="autovacuum off for the outbox; the router's own vacuum at its default "
    "(outbox.vacuum_after_rows 50,000 marked rows, or 1,000 after 60 s)",
)
ON = Variant("autovacuum on", True, None, "autovacuum on for the outbox (server-wide on)")
SWITCHED_ON = Variant(
    "autovacuum on",
    True,
    None,
    "autovacuum switched on server-wide for these runs only (ALTER SYSTEM + reload, reset "
    "after each), at the server's own naptime and thresholds",
)
PER_SECOND = ["s", "committed", "txn p99 ms", "arrived", "p50 ms", "p99 ms", "max ms"]
PER_SECOND += ["missing", "n_dead_tup", "n_live_tup", "open rows", "vacuums"]
SUMMARY = ["run", "variant", "commit/s", "late s", "committed", "delivered", "p50 ms"]
SUMMARY += ["p99 ms", "max ms", "p99 0-10s", "p99 last 10s", "drift ms", "steady drift ms"]
SUMMARY += ["drain s", "max open"]
SUMMARY_KEYS = ["variant", "commit_rate", "producer_late_s", "committed", "delivered", "p50_ms"]
SUMMARY_KEYS += ["p99_ms", "max_ms", "p99_first_10s_ms", "p99_last_10s_ms", "drift_ms"]
SUMMARY_KEYS += ["steady_drift_ms", "drain_s", "max_open_rows"]


@contextlib.asynccontextmanager
async def server_autovacuum(switch: bool) -> AsyncIterator[None]:
    """Autovacuum on server-wide while the block runs (when ``switch``); the server's
    configuration files are left as they were."""
    if not switch:
        yield
        return
    admin = await asyncpg.connect(ADMIN_DSN)
    try:
        await admin.execute("ALTER SYSTEM SET autovacuum = on")
        await admin.execute("SELECT pg_reload_conf()")
        yield
    finally:
        await admin.execute("ALTER SYSTEM RESET autovacuum")
        await admin.execute("SELECT pg_reload_conf()")
        await admin.close()


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of sorted ``values``; 0 for none."""
    if not values:
        return 0.0
    return values[max(0, min(len(values) - 1, round(q / 100 * len(values)) - 1))]


async def variants(choice: str, vacuum_after_rows: int, switch: bool) -> list[Variant]:
    """The variants ``--autovacuum`` asks for, as this server can run them."""
    admin = await asyncpg.connect(ADMIN_DSN)
    try:
        global_autovacuum = await admin.fetchval("SHOW autovacuum")
    finally:
        await admin.close()
    vacuumed = ON
    if choice != "off" and global_autovacuum != "on" and switch:
        vacuumed = SWITCHED_ON
    elif choice != "off" and global_autovacuum != "on":
        vacuumed = Variant(
            f"router vacuum/{vacuum_after_rows}",
            None,
            vacuum_after_rows,
            f"autovacuum is {global_autovacuum} server-wide: 'on' cannot be tested here "
            "unless --server-autovacuum may switch it on (the per-table switch does nothing "
            "while the global one is off); ran instead with outbox.vacuum_after_rows = "
            f"{vacuum_after_rows}",
        )
    return {"off": [OFF], "on": [vacuumed], "both": [OFF, vacuumed]}[choice]


def latencies_ms(trace: Trace, first: float = 0.0, last: float = float("inf")) -> list[float]:
    """Sorted commit-to-arrival latencies of the events committed in [first, last) s."""
    return sorted(
        (trace.arrived[i] - t) * 1000
        for i, t in trace.committed.items()
        if i in trace.arrived and first <= t - trace.started < last
    )


def per_second(trace: Trace) -> list[dict[str, Any]]:
    """One row per second of the run by commit time, with the sample taken at its end."""
    seconds = int(max(trace.committed.values()) - trace.started) + 1
    samples: dict[int, Sample] = {round(s.at) - 1: s for s in trace.samples}
    committed, arrivals = [0] * seconds, [0] * seconds
    latencies: list[list[float]] = [[] for _ in range(seconds)]
    transactions: list[list[float]] = [[] for _ in range(seconds)]
    for message_id, t in trace.committed.items():
        s = int(t - trace.started)
        committed[s] += 1
        transactions[s].append(trace.transaction_ms[message_id])
        if message_id in trace.arrived:
            latencies[s].append((trace.arrived[message_id] - t) * 1000)
    for t in trace.arrived.values():
        if 0 <= t - trace.started < seconds:
            arrivals[int(t - trace.started)] += 1
    return [
        {
            "second": s,
            "committed": committed[s],
            "txn_p99_ms": round(percentile(sorted(transactions[s]), 99), 1),
            "arrived": arrivals[s],
            **spread(sorted(latencies[s])),
            "missing": committed[s] - len(latencies[s]),
            **table_figures(samples.get(s)),
        }
        for s in range(seconds)
    ]


def spread(values: list[float]) -> dict[str, float]:
    """p50, p99 and max of sorted latencies, in ms."""
    return {
        "p50_ms": round(percentile(values, 50), 1),
        "p99_ms": round(percentile(values, 99), 1),
        "max_ms": round(values[-1] if values else 0.0, 1),
    }


def table_figures(sample: Sample | None) -> dict[str, int | None]:
    """A sample's columns (None where the statistics had nothing yet)."""
    return {
        "n_dead_tup": sample.dead if sample else None,
        "n_live_tup": sample.live if sample else None,
        "open_rows": sample.open if sample else None,
        "vacuums": sample.vacuums if sample else None,
    }


def summary(trace: Trace, variant: Variant, seconds: float) -> dict[str, Any]:
    """The whole run's figures."""
    whole = latencies_ms(trace)
    end = max(trace.committed.values()) - trace.started
    first, last = latencies_ms(trace, 0, 10), latencies_ms(trace, end - 10)
    # Events committed before the router's first delivery waited for its start-up, which
    # would hide any creep after it: the steady drift starts with the first full second
    # after that delivery.
    steady = math.ceil(min(trace.arrived.values(), default=trace.started) - trace.started)
    settled = latencies_ms(trace, steady, steady + 10)
    during = [s.open for s in trace.samples if s.at <= trace.produced - trace.started + 0.5]
    return {
        "variant": variant.name,
        "commit_rate": round(len(trace.committed) / (trace.produced - trace.started), 1),
        # How far behind its schedule the producer ended: one connection waits for each
        # commit's WAL flush, so the offered rate is what the disk allows, at most.
        "producer_late_s": round(trace.produced - trace.started - seconds, 2),
        "committed": len(trace.committed),
        "delivered": len(whole),
        **spread(whole),
        "p99_first_10s_ms": round(percentile(first, 99), 1),
        "p99_last_10s_ms": round(percentile(last, 99), 1),
        "drift_ms": round(percentile(last, 99) - percentile(first, 99), 1),
        "steady_from_s": steady,
        "p99_steady_first_10s_ms": round(percentile(settled, 99), 1),
        "steady_drift_ms": round(percentile(last, 99) - percentile(settled, 99), 1),
        "drain_s": round(max(0.0, max(trace.arrived.values(), default=0.0) - trace.produced), 2),
        "max_open_rows": max(during, default=0),
        "router_exit": trace.router_exit,
    }


def show_run(number: int, variant: Variant, rows: list[dict[str, Any]], trace: Trace) -> None:
    """The per-second table of one run."""
    print_table(
        f"\nrun {number}: {variant.name} — per second of the run, by commit time "
        "(arrived: messages arriving in that second; table figures sampled at its end)",
        PER_SECOND,
        [["-" if v is None else v for v in row.values()] for row in rows],
    )
    if trace.router_exit is not None:
        print(f"  router serve exited early ({trace.router_exit}); log: {trace.router_log}")


async def main() -> None:
    """Run, print and save."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=800.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--autovacuum", choices=["off", "on", "both"], default="both")
    parser.add_argument("--vacuum-after-rows", type=int, default=5000)
    parser.add_argument(
        "--server-autovacuum",
        action="store_true",
        help="for the 'on' runs, switch autovacuum on server-wide when it is off, and back",
    )
    parser.add_argument(
        "--producer-async",
        action="store_true",
        help="the producer commits with synchronous_commit off: for a disk whose fsync is "
        "too slow for one connection to commit --rate transactions a second",
    )
    args = parser.parse_args()
    chosen = await variants(args.autovacuum, args.vacuum_after_rows, args.server_autovacuum)
    for variant in chosen:
        print(f"{variant.name}: {variant.note}")
    results: list[dict[str, Any]] = []
    # Variants take turns within each round, so drift on the shared machine hits them alike.
    for variant in [v for _ in range(args.runs) for v in chosen]:
        async with server_autovacuum(variant is SWITCHED_ON):
            trace = await run(
                variant, args.rate, args.seconds, producer_sync=not args.producer_async
            )
        rows = per_second(trace)
        show_run(len(results) + 1, variant, rows, trace)
        samples = [vars(s) for s in trace.samples]  # the drain's seconds too
        results.append(
            {**summary(trace, variant, args.seconds), "per_second": rows, "samples": samples}
        )
    print_table(
        f"\ntrickle: {args.rate:,.0f} events/s for {args.seconds:,.0f} s, one producer "
        "connection, fresh router serve (1 process), file stream; drift = p99 of the last "
        "10 s minus the first 10 s; steady drift: minus the first 10 s after the router's first "
        "delivery; late: how far behind schedule the producer ended; drain: last arrival "
        "after the producer stopped",
        SUMMARY,
        [[n + 1, *[r[k] for k in SUMMARY_KEYS]] for n, r in enumerate(results)],
    )
    parameters = vars(args) | {"variants": {v.name: v.note for v in chosen}}
    path = write_results("trickle", parameters, results)
    print(f"written to {path.relative_to(path.parents[2])}")


if __name__ == "__main__":
    uvloop.run(main())  # as router serve runs: the producer's own overhead stays small
