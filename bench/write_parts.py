"""write_parts: what each part of stage()'s statement costs PostgreSQL, without Python.

    python -m bench.write_parts [--writers 1,8,32] [--seconds 4] [--rounds 3]
                                [--output write-parts]

``pgbench`` (C, prepared statements, K clients) runs transactions of one ``orders`` row and one
outbox row, as ``bench.write_concurrency``'s writers do, so the figures are the server's and
the disk's alone. The outbox row, one part added at a time:

- ``hand``: the hand outbox of ``bench._writers`` (uuid, target, type, key, jsonb; an index on
  the pending rows), the event's JSON as its payload;
- ``flat``: the router's columns and its stored envelope of the same event, into a table
  like one slot of the queue (the same columns, defaults and indexes) but not partitioned;
- ``small``: ``router_outbox`` itself (two partition levels), the event's JSON alone as the
  envelope: the table without the envelope's size;
- ``table``: ``router_outbox`` with the router's envelope (what stage() writes);
- ``lock``: the same behind the stream-key lock (``pg_advisory_xact_lock`` on the key's slot);
- ``gate``: the same behind the lock and the wake try (stage()'s one-event statement, with no
  relay idle, so no NOTIFY).

Interleaved rounds, the order rotated; per K the median of each round's ratio to ``hand``
and its range. ``bench.write_concurrency`` measures the whole call, Python included.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import psycopg

from bench import _mysql
from bench._common import order, print_table, write_results
from bench._writers import create_tables
from bench.write_concurrency import numbers, spread
from router.config import RouterConfig
from router.write.staging import Stager
from tests.private_postgres import postgres_bin

PARTS = ("hand", "flat", "small", "table", "lock", "gate")

_ORDER = "INSERT INTO orders (id, customer, total) VALUES (:n, 'c', 1.99);"
_ROUTER = (
    "INSERT INTO {table} (message_id, target, destination, event_type, stream_key, envelope) "
    "VALUES (gen_random_uuid(), 'events', :dest, 'order_placed', 'order-' || :n, {envelope});"
)
_GATED = (
    "INSERT INTO router_outbox (message_id, target, destination, event_type, stream_key, "
    "envelope) SELECT * FROM (VALUES (gen_random_uuid(), 'events', :dest, 'order_placed', "
    "'order-' || :n, CAST(:envelope AS json))) AS r WHERE (SELECT true FROM (SELECT {calls}) AS g);"
)
_LOCK = "pg_advisory_xact_lock(1869903202, hashtext('order-' || :n) & 1023)"
_WAKE = (
    "CASE WHEN pg_try_advisory_xact_lock_shared(1869903205, hashtext('events')) THEN NULL "
    "ELSE pg_notify('router_outbox', 'events') END"
)
# Variables are bind parameters under -M prepared, so the JSON texts go in with -D.
SCRIPTS = {
    "hand": "INSERT INTO hand_outbox (id, target, type, key, payload) VALUES "
    "(gen_random_uuid(), 'events', 'order_placed', 'order-' || :n, CAST(:payload AS jsonb));",
    "flat": _ROUTER.format(table="flat_outbox", envelope="CAST(:envelope AS json)"),
    "small": _ROUTER.format(table="router_outbox", envelope="CAST(:payload AS json)"),
    "table": _ROUTER.format(table="router_outbox", envelope="CAST(:envelope AS json)"),
    "lock": _GATED.format(calls=_LOCK),
    "gate": _GATED.format(calls=f"{_LOCK}, {_WAKE}"),
}
# One queue slot's shape, unpartitioned, its seq from a sequence of its own.
FLAT = (
    "CREATE TABLE flat_outbox (LIKE router_outbox_q0 INCLUDING ALL)",
    "CREATE SEQUENCE flat_outbox_seq",
    "ALTER TABLE flat_outbox ALTER seq SET DEFAULT nextval('flat_outbox_seq')",
)


def texts() -> tuple[str, str]:
    """The bench event's JSON, and the envelope stage() stores for it."""
    event = order(1)
    config = RouterConfig.model_validate(
        {
            "service": "bench",
            "databases": {"main": "postgresql://localhost/x"},
            "brokers": {
                "events": {
                    "type": "nats",
                    "internal": True,
                    "destination": "bench.{event_type}",
                    "stream": {"name": "BENCH", "subjects": ["bench.>"]},
                }
            },
        }
    )
    [row] = Stager(config).build_rows("main", [event], stream_key="order-1")
    return event.model_dump_json(), row.envelope


def run(
    pgbench: Path, url: str, script: Path, writers: int, seconds: float, defines: list[str]
) -> float:
    """Transactions per second of one pgbench run."""
    clients = ["-c", str(writers), "-j", str(min(writers, 2)), "-T", str(round(seconds))]
    done = subprocess.run(
        [str(pgbench), "-n", "-M", "prepared", *clients, "-f", str(script), *defines, url],
        capture_output=True,
        text=True,
        check=False,
    )
    found = re.search(r"tps = ([\d.]+)", done.stdout)
    if found is None:
        raise RuntimeError(f"pgbench failed: {done.stderr[-800:]}")
    return float(found.group(1))


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every round: per K, every part in turn (rotated by the round)."""
    bin_folder = postgres_bin()
    if bin_folder is None or not (bin_folder / "pgbench").exists():
        raise SystemExit("pgbench not found (PostgreSQL's server programs)")
    pgbench = bin_folder / "pgbench"
    payload, envelope = texts()
    defines = [
        "-D",
        f"payload={payload}",
        "-D",
        f"envelope={envelope}",
        "-D",
        "dest=bench.order_placed",
    ]
    runs: dict[tuple[int, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="write-parts-") as folder:
        scripts = {}
        for part, statement in SCRIPTS.items():
            path = Path(folder) / f"{part}.sql"
            path.write_text(
                f"\\set n random(1, 9000000000000)\nBEGIN;\n{_ORDER}\n{statement}\nCOMMIT;\n"
            )
            scripts[part] = path
        async with _mysql.fresh_database("postgresql", "write_parts") as url:
            create_tables("postgresql", url)
            with psycopg.connect(url, autocommit=True) as conn:
                for statement in FLAT:
                    conn.execute(statement)
            for round_ in range(args.rounds):
                for writers in args.writers:
                    order_ = PARTS[round_ % len(PARTS) :] + PARTS[: round_ % len(PARTS)]
                    for part in order_:
                        rate = await asyncio.to_thread(
                            run, pgbench, url, scripts[part], writers, args.seconds, defines
                        )
                        runs.setdefault((writers, part), []).append(rate)
                        print(
                            f"  round {round_ + 1} K={writers} {part}: {rate:,.0f} tps", flush=True
                        )
    figures: dict[str, Any] = {}
    for writers in args.writers:
        hand = runs[(writers, "hand")]
        point: dict[str, Any] = {"hand_tps": spread(hand)}
        for part in PARTS[1:]:
            point[part] = spread(
                [r / h for r, h in zip(runs[(writers, part)], hand, strict=True)], 3
            )
        figures[str(writers)] = point
    return figures


def main() -> None:
    """Measure, print, save."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writers", type=numbers, default=[1, 8, 32])
    parser.add_argument("--seconds", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", default="write-parts", help="bench/results/OUTPUT.json")
    args = parser.parse_args()
    figures = asyncio.run(measure(args))

    def cell(f: dict[str, Any]) -> str:
        return f"{f['median']:.2f} ({f['min']:.2f}-{f['max']:.2f})"

    print_table(
        f"write_parts: pgbench, an orders row and an outbox row a transaction, "
        f"{args.seconds:g} s a point; each part over hand, median (lowest-highest) of "
        f"{args.rounds} rounds",
        ["K", "hand tps", *PARTS[1:]],
        [
            [k, f"{p['hand_tps']['median']:,.0f}", *(cell(p[part]) for part in PARTS[1:])]
            for k, p in figures.items()
        ],
    )
    parameters = {"writers": args.writers, "seconds": args.seconds, "rounds": args.rounds}
    print(f"written to {write_results(args.output, parameters, figures)}")


if __name__ == "__main__":
    main()
