"""stage_cpu: the client's instructions a transaction, stage() against the hand outbox.

    python -m bench.stage_cpu [--clients psycopg,asyncpg,mysql] [--transactions 300,1300]
                              [--output stage-cpu]

``bench.write_concurrency``'s transactions (one ``orders`` row and one event, committed), run
one after another on one connection of each client (``bench._writers``), under valgrind's
callgrind, which counts every instruction the Python process executes: ``hand`` (the hand
outbox's prepared INSERT) and ``stage`` (``SyncOutbox.stage``; ``Outbox.stage`` on asyncpg,
on uvloop). Each mode runs at
two transaction counts; the difference over the difference of the counts is the cost of one
transaction without the process's start. The counts do not move with the machine's load or
its disk (two runs of each mode differed by up to 4%, the ratio by 1%), so they show a cut of
a tenth in stage()'s own work that ``bench.write_concurrency``'s commits/s, within the disk's
noise, cannot. With K writers on two cores the client's CPU is what bounds the commits a second
(the GIL, or asyncpg's one event loop: one core for all writers), so the ratio of the counts
is about the ratio of commits/s from 4 writers on.

One bias, against stage(): under valgrind a clock read or ``os.urandom`` is a system call of
about 10,000 instructions (no vDSO), where it takes a few hundred outside. stage() reads the
clock twice a call (its id's milliseconds, the envelope's time), the hand outbox draws 16
random bytes once (uuid4): about 10,000 instructions of each transaction's difference are
valgrind's.

Needs ``valgrind`` (Debian: ``apt install valgrind``); slow (about a minute a run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from bench import _mysql
from bench._common import print_table, write_results
from bench._writers import CLIENTS, KIND, TARGET, create_tables, make_client
from bench.write_concurrency import entered, numbers
from router.config import RouterConfig

_COLLECTED = re.compile(r"Collected : ([\d,]+)")


def config(urls: dict[str, str]) -> dict[str, Any]:
    """The writers' config: the databases by kind, one internal target (never connected)."""
    return {
        "service": "bench",
        "databases": urls,
        "brokers": {
            TARGET: {
                "type": "nats",
                "url": "nats://127.0.0.1:4222",
                "internal": True,
                "stream": {"name": "STAGE_CPU", "subjects": [">"]},
            }
        },
        "http": {"enabled": False},
    }


def instructions(client: str, mode: str, count: int, url: str, config_file: Path) -> int:
    """The instructions of a process running ``count`` transactions (callgrind's total)."""
    command = [
        "valgrind",
        "--tool=callgrind",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        "-m",
        "bench.stage_cpu",
        "--inner",
        client,
        mode,
        str(count),
        url,
        str(config_file),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    found = _COLLECTED.search(done.stderr)
    if found is None:
        raise RuntimeError(f"no instruction count from callgrind: {done.stderr[-500:]}")
    return int(found.group(1).replace(",", ""))


def inner(client: str, mode: str, count: int, url: str, config_file: Path) -> None:
    """Run under callgrind: ``count`` transactions, after the caches' first one."""
    parsed = RouterConfig.model_validate(yaml.safe_load(config_file.read_text()))
    writer = make_client(client, url, parsed)
    # Each run's orders apart from the earlier runs' in the same database.
    writer.run(mode, count, first=os.getpid() * 10_000_000)


def measure(clients: list[str], counts: list[int]) -> dict[str, Any]:
    """Instructions a transaction, per client and mode."""
    kinds = sorted({KIND[c] for c in clients}, reverse=True)
    figures: dict[str, Any] = {}
    with (
        asyncio.Runner() as runner,
        contextlib.ExitStack() as stack,
        tempfile.TemporaryDirectory() as tmp,
    ):
        urls = {
            kind: entered(runner, stack, _mysql.fresh_database(kind, "stage_cpu")) for kind in kinds
        }
        for kind, url in urls.items():
            create_tables(kind, url)
        config_file = Path(tmp) / "config.yaml"
        config_file.write_text(yaml.safe_dump(config(urls)))
        for client in clients:
            url = urls[KIND[client]]
            per_mode: dict[str, float] = {}
            for mode in ("hand", "stage"):
                low, high = (instructions(client, mode, n, url, config_file) for n in counts)
                per_mode[mode] = round((high - low) / (counts[1] - counts[0]))
                print(f"  {client} {mode}: {per_mode[mode]:,} instructions a transaction")
            per_mode["stage_over_hand"] = round(per_mode["stage"] / per_mode["hand"], 3)
            per_mode["stage_minus_hand"] = per_mode["stage"] - per_mode["hand"]
            figures[client] = per_mode
    return figures


def main() -> None:
    """Measure, print, save; or, with ``--inner``, be the measured process."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=lambda s: s.split(","), default=list(CLIENTS))
    parser.add_argument("--transactions", type=numbers, default=[300, 1300])
    parser.add_argument("--output", help="bench/results/OUTPUT.json")
    parser.add_argument("--inner", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        client, mode, count, url, config_file = args.inner
        inner(client, mode, int(count), url, Path(config_file))
        return
    if unknown := set(args.clients) - set(CLIENTS):
        parser.error(f"no such client: {', '.join(sorted(unknown))}")
    if len(args.transactions) != 2 or args.transactions[0] >= args.transactions[1]:
        parser.error("--transactions takes two counts, the smaller first")
    if shutil.which("valgrind") is None:
        parser.error("valgrind is needed (apt install valgrind)")
    figures = measure(args.clients, args.transactions)
    print_table(
        "stage_cpu: client instructions a transaction (callgrind), one connection",
        ["client", "hand", "stage", "stage/hand", "stage - hand"],
        [
            [
                c,
                f"{f['hand']:,}",
                f"{f['stage']:,}",
                f"{f['stage_over_hand']:.2f}",
                f"{f['stage_minus_hand']:,}",
            ]
            for c, f in figures.items()
        ],
    )
    parameters = {"clients": args.clients, "transactions": args.transactions}
    path = write_results(args.output or "stage-cpu", parameters, figures)
    print(f"written to {path}")


if __name__ == "__main__":
    main()
