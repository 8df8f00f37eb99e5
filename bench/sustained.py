"""sustained: commit-to-ack latency per target under a steady mixed load, and the rate it holds.

    python -m bench.sustained [--rates 1000,2500,5000] [--seconds 60] [--mode single|multi|both]
                              [--connections 8] [--per-transaction 5]

Producers commit on absolute deadlines: ``single`` is one connection committing one event per
transaction (each its own stream key); ``multi`` is ``--connections`` connections sharing the
offered rate, each committing ``--per-transaction`` events per transaction (one stream key per
transaction). ``router serve --workers 1`` delivers every event to three targets, each a fresh
file stream: the internal NATS broker and two partners (external NATS brokers; OrderPlaced is
published, so each event is one row per target).

Each rate and mode gets a fresh database, fresh streams and a freshly started router. The
measured period starts once the router has stored a warm-up event on all three targets, so its
start-up is not in the figures. Latency is from the moment COMMIT returned to the moment
JetStream stored the message (the stream's own timestamp, taken just before it acks the
router), read back from the streams after the router stopped, so measuring adds no work while
the router runs. Events are counted by commit time; an event not stored by the end of the
bounded tail wait counts as not delivered.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import uvloop

from bench._common import print_table, write_results
from bench._sustained_run import TARGETS, Plan, Trace, run

LIMIT_MS = 50.0
# The producer kept up when it committed at least this share of the offered rate: below it,
# the router was offered less than the rate says, and the run is flagged.
KEPT_UP = 0.98
SUMMARY = ["mode", "offered/s", "commit/s", "producer", "target", "delivered/s", "p50 ms"]
SUMMARY += ["p99 ms", "max ms", "not delivered"]
WINDOW = ["s", "commit/s", *(f"{t} p99" for t in TARGETS), *(f"{t} max" for t in TARGETS)]
WINDOW += ["missing"]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of sorted ``values``; 0 for none."""
    if not values:
        return 0.0
    return values[max(0, min(len(values) - 1, round(q / 100 * len(values)) - 1))]


def spread(values: list[float]) -> dict[str, float]:
    """p50, p99 and max of sorted latencies, in ms."""
    return {
        "p50_ms": round(percentile(values, 50), 1),
        "p99_ms": round(percentile(values, 99), 1),
        "max_ms": round(values[-1] if values else 0.0, 1),
    }


def latencies(trace: Trace, target: str) -> list[float]:
    """Sorted commit-to-stored ms on ``target`` of the events committed."""
    stored = trace.stored[target]
    return sorted((stored[i] - t) * 1000 for i, t in trace.committed.items() if i in stored)


def target_figures(trace: Trace, target: str, plan: Plan) -> dict[str, Any]:
    """One target over the whole measured period."""
    values = latencies(trace, target)
    stored = trace.stored[target]
    last = max((stored[i] for i in trace.committed if i in stored), default=trace.started)
    return {
        "delivered": len(values),
        "delivered_rate": round(len(values) / max(plan.seconds, last - trace.started), 1),
        **spread(values),
        "not_delivered": len(trace.committed) - len(values),
        "duplicates": trace.duplicates[target],
    }


def per_second(trace: Trace, plan: Plan) -> list[dict[str, Any]]:
    """One row per second of the measured period by commit time; ``stored``: messages the
    target stored during that second."""
    seconds = math.ceil(plan.seconds)

    def second(t: float) -> int:
        # A transaction begun just before the period ended counts in its last second.
        return min(int(t - trace.started), seconds - 1)

    committed = [0] * seconds
    for t in trace.committed.values():
        committed[second(t)] += 1
    rows: list[dict[str, Any]] = [{"second": s, "committed": committed[s]} for s in range(seconds)]
    for target in TARGETS:
        stored = trace.stored[target]
        landed = [0] * seconds
        for t in stored.values():
            if 0 <= t - trace.started < seconds:
                landed[int(t - trace.started)] += 1
        buckets: list[list[float]] = [[] for _ in range(seconds)]
        for i, t in trace.committed.items():
            if i in stored:
                buckets[second(t)].append((stored[i] - t) * 1000)
        for s, row in enumerate(rows):
            row[target] = {"stored": landed[s], **spread(sorted(buckets[s]))}
            row[target]["missing"] = committed[s] - len(buckets[s])
    return rows


def summary(trace: Trace, plan: Plan) -> dict[str, Any]:
    """The run's figures."""
    elapsed = trace.produced - trace.started
    committed = len(trace.committed)
    commit_rate = committed / max(plan.seconds, elapsed)
    lateness = sorted(trace.lateness_ms)
    connections, size = plan.shape
    return {
        "mode": plan.mode,
        "offered_rate": plan.rate,
        "connections": connections,
        "events_per_transaction": size,
        "warm_up_s": round(trace.warm_up_s, 2),
        "committed": committed,
        "commit_rate": round(commit_rate, 1),
        "producer_kept_up": commit_rate >= KEPT_UP * plan.rate,
        # How far behind its schedule the producer was when the period ended (the events it
        # never committed, at the offered rate), and how late transactions began.
        "producer_behind_s": round(max(0.0, plan.rate * plan.seconds - committed) / plan.rate, 2),
        "begin_late_p99_ms": round(percentile(lateness, 99), 1),
        "begin_late_max_ms": round(lateness[-1] if lateness else 0.0, 1),
        "tail_s": round(trace.tail_s, 2),
        "router_exit": trace.router_exit,
        "targets": {t: target_figures(trace, t, plan) for t in TARGETS},
    }


def show_windows(result: dict[str, Any]) -> None:
    """The per-second rows folded into 10-s windows: p99 and max per target."""
    rows = []
    seconds = result["per_second"]
    for first in range(0, len(seconds), 10):
        window = seconds[first : first + 10]
        cells: list[object] = [f"{first}-{first + len(window)}"]
        cells.append(round(sum(r["committed"] for r in window) / len(window)))
        cells += [max(r[t]["p99_ms"] for r in window) for t in TARGETS]
        cells += [max(r[t]["max_ms"] for r in window) for t in TARGETS]
        cells.append(sum(r[t]["missing"] for r in window for t in TARGETS))
        rows.append(cells)
    print_table(
        f"\n{result['mode']} at {result['offered_rate']:,.0f}/s — per 10 s by commit time "
        "(p99: the worst second's p99 in the window)",
        WINDOW,
        rows,
    )


def holds(result: dict[str, Any]) -> bool:
    """Whether a run held its rate: the producer kept up, every event reached every target,
    and p99 stayed within the limit on every target over the whole period."""
    return result["producer_kept_up"] and all(
        f["p99_ms"] <= LIMIT_MS and f["not_delivered"] == 0 for f in result["targets"].values()
    )


def highest(results: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    """Per mode, the highest offered rate held, and the rates the producer could not offer."""
    return {
        mode: {
            "highest_rate_held": max(
                (r["offered_rate"] for r in results if r["mode"] == mode and holds(r)),
                default=None,
            ),
            "producer_behind_at": [
                r["offered_rate"]
                for r in results
                if r["mode"] == mode and not r["producer_kept_up"]
            ],
        }
        for mode in modes
    }


async def main() -> None:
    """Run every rate and mode, print and save."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="1000,2500,5000")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--mode", choices=["single", "multi", "both"], default="both")
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--per-transaction", type=int, default=5)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    modes = ["single", "multi"] if args.mode == "both" else [args.mode]
    results: list[dict[str, Any]] = []
    # Modes take turns at each rate, so drift on the shared machine hits them alike.
    for rate in rates:
        for mode in modes:
            plan = Plan(mode, rate, args.seconds, args.connections, args.per_transaction)
            trace = await run(plan)
            result = summary(trace, plan) | {"per_second": per_second(trace, plan)}
            print(
                f"\n{mode} at {rate:,.0f}/s: warm-up event stored on all {len(TARGETS)} targets "
                f"{result['warm_up_s']} s after router serve was spawned; measured period "
                f"started then; tail waited {result['tail_s']} s after the last commit"
            )
            if not result["producer_kept_up"]:
                print(
                    f"  PRODUCER BEHIND: committed {result['commit_rate']:,.0f}/s of "
                    f"{rate:,.0f}/s offered, {result['producer_behind_s']} s behind schedule when "
                    "the period ended; its commit times may then be noted late, so latency "
                    "reads low"
                )
            if trace.router_exit is not None:
                print(f"  router serve exited early ({trace.router_exit}); {trace.router_log}")
            show_windows(result)
            results.append(result)
    print_table(
        f"\nsustained: {args.seconds:,.0f} s per rate, router serve --workers 1, 3 file "
        f"streams; single: 1 connection x 1 event/txn; multi: {args.connections} connections "
        f"x {args.per_transaction} events/txn; latency: COMMIT returned -> JetStream stored",
        SUMMARY,
        [
            [
                r["mode"],
                f"{r['offered_rate']:,.0f}",
                f"{r['commit_rate']:,.0f}",
                "kept up" if r["producer_kept_up"] else f"BEHIND {r['producer_behind_s']} s",
                target,
                f"{f['delivered_rate']:,.0f}",
                f["p50_ms"],
                f["p99_ms"],
                f["max_ms"],
                f["not_delivered"],
            ]
            for r in results
            for target, f in r["targets"].items()
        ],
    )
    verdict = highest(results, modes)
    print_table(
        f"\nhighest offered rate held over the whole {args.seconds:,.0f} s: producer kept up, "
        f"p99 <= {LIMIT_MS:.0f} ms and nothing undelivered on every target",
        ["mode", "highest rate held", "producer behind at"],
        [
            [
                mode,
                "none" if v["highest_rate_held"] is None else f"{v['highest_rate_held']:,.0f}/s",
                ", ".join(f"{r:,.0f}/s" for r in v["producer_behind_at"]) or "-",
            ]
            for mode, v in verdict.items()
        ],
    )
    parameters = vars(args) | {"rates": rates, "targets": list(TARGETS), "p99_limit_ms": LIMIT_MS}
    path = write_results("sustained", parameters, {"runs": results, "highest": verdict})
    print(f"written to {path.relative_to(path.parents[2])}")


if __name__ == "__main__":
    uvloop.run(main())  # as router serve runs: the producers' own overhead stays small
