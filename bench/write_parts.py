"""write_parts: what each part of stage()'s statement costs the database, without Python.

    python -m bench.write_parts [--database postgresql|mysql] [--writers 1,8,32] [--seconds 4]
                                [--rounds 3] [--transactions 4000] [--rollback]
                                [--parts flat,nounit,...]
                                [--output write-parts]

``pgbench`` (C, prepared statements, K clients) runs transactions of one ``orders`` row and one
outbox row, as ``bench.write_concurrency``'s writers do, so the figures are the server's and
the disk's alone. The outbox row, one part added at a time:

- ``hand``: the hand outbox of ``bench._writers`` (uuid, target, type, key, jsonb; an index on
  the pending rows), the event's JSON as its payload;
- ``flat``: the router's columns and its stored envelope of the same event, into a table
  like one slot of the queue (the same columns, defaults and indexes) but not partitioned;
- ``nounit``: the same without the slot's index of transaction units (``ix_router_outbox_unit``,
  which only ``atomic`` targets read);
- ``queue``: the router's row into ``router_outbox_queue``, the partition every new row goes
  to: one level of routing less than ``router_outbox``;
- ``small``: ``router_outbox`` itself (two partition levels), the event's JSON alone as the
  envelope: the table without the envelope's size;
- ``table``: ``router_outbox`` with the router's envelope (what stage() writes);
- ``lock``: the same behind the stream-key lock (``pg_advisory_xact_lock`` on the key's slot);
- ``gate``: the same behind the lock and the wake try (stage()'s one-event statement, with no
  relay idle, so no NOTIFY);
- ``spread``: ``gate`` with the wake try on one of 16 locks (by backend pid) instead of the
  target's one lock that every writer shares: whether that one lock is a hot spot.

On MariaDB (``--database mysql``; ``write-parts-mysql.json`` by default) ``mariadb-slap`` (C)
runs ``--transactions`` such transactions over K clients, each one ``START TRANSACTION``, ``SET
@n = UUID_SHORT()`` (the business row's id and the stream key's), the ``orders`` row, the
outbox row, ``COMMIT``. The envelope goes as a hex literal, as stage() sends it. The parts:

- ``hand``: the hand outbox of ``bench._writers`` (a ``CHECK (JSON_VALID(...))`` payload, an
  index on the pending rows);
- ``table``: ``router_outbox`` with the router's envelope, a plain ``INSERT ... VALUES`` (what
  stage() writes for a row without a stream key);
- ``nounit``: the same into a copy of ``router_outbox`` without its index of transaction units
  (``ix_router_outbox_unit``, which only ``atomic`` targets read);
- ``small``: the same with the event's JSON alone as the envelope;
- ``read``: the row inserted by ``INSERT ... SELECT`` from the key's slot row of
  ``router_streams``, without locking it: what reading a second table in the statement costs;
- ``lock``: the same ``FOR UPDATE``, stage()'s statement for a row on a stream key;
- ``apart``: the slot's row locked by a ``SELECT ... FOR UPDATE`` of its own, then the plain
  ``INSERT ... VALUES``: whether the cost is the lock or the INSERT's form.

``--rollback`` ends each transaction with ``ROLLBACK`` instead: no commit waits for the disk,
so what is left is the statements' own work on the server, which the flush's noise on this
machine (a fifth between rounds) hides in the committed figures (``write-parts-rollback.json``,
``write-parts-mysql-rollback.json``).

Interleaved rounds, the order rotated; per K the median of each round's ratio to ``hand``
and its range. ``bench.write_concurrency`` measures the whole call, Python included.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg

from bench import _mysql
from bench._common import order, print_table, write_results
from bench._writers import create_tables
from bench.write_concurrency import numbers, spread
from router.config import RouterConfig
from router.write.staging import Stager
from tests.private_postgres import postgres_bin

PARTS = ("hand", "flat", "nounit", "queue", "small", "table", "lock", "gate", "spread")
MYSQL_PARTS = ("hand", "table", "nounit", "small", "read", "lock", "apart")

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
_SPREAD_WAKE = _WAKE.replace("hashtext('events')", "hashtext('events:' || (pg_backend_pid() & 15))")
# Variables are bind parameters under -M prepared, so the JSON texts go in with -D.
SCRIPTS = {
    "hand": "INSERT INTO hand_outbox (id, target, type, key, payload) VALUES "
    "(gen_random_uuid(), 'events', 'order_placed', 'order-' || :n, CAST(:payload AS jsonb));",
    "flat": _ROUTER.format(table="flat_outbox", envelope="CAST(:envelope AS json)"),
    "nounit": _ROUTER.format(table="nounit_outbox", envelope="CAST(:envelope AS json)"),
    # The identity of router_outbox's seq is the parent's: a row put into a partition
    # draws its seq itself.
    "queue": "INSERT INTO router_outbox_queue (seq, message_id, target, destination, event_type,"
    " stream_key, envelope) VALUES (nextval('router_outbox_seq_seq'), gen_random_uuid(),"
    " 'events', :dest, 'order_placed', 'order-' || :n, CAST(:envelope AS json));",
    "small": _ROUTER.format(table="router_outbox", envelope="CAST(:payload AS json)"),
    "table": _ROUTER.format(table="router_outbox", envelope="CAST(:envelope AS json)"),
    "lock": _GATED.format(calls=_LOCK),
    "gate": _GATED.format(calls=f"{_LOCK}, {_WAKE}"),
    "spread": _GATED.format(calls=f"{_LOCK}, {_SPREAD_WAKE}"),
}
# One queue slot's shape, unpartitioned, its seq from a sequence of its own.
FLAT = (
    "CREATE TABLE flat_outbox (LIKE router_outbox_q0 INCLUDING ALL)",
    "CREATE SEQUENCE flat_outbox_seq",
    "ALTER TABLE flat_outbox ALTER seq SET DEFAULT nextval('flat_outbox_seq')",
    "CREATE TABLE nounit_outbox (LIKE router_outbox_q0 INCLUDING ALL)",
    "ALTER TABLE nounit_outbox ALTER seq SET DEFAULT nextval('flat_outbox_seq')",
    # LIKE names the copied indexes itself: the units' one is the one on (target, xid).
    "DO $$ BEGIN EXECUTE (SELECT 'DROP INDEX ' || indexrelid::regclass::text FROM pg_index"
    " WHERE indrelid = 'nounit_outbox'::regclass"
    " AND pg_get_indexdef(indexrelid) LIKE '%(target, xid)%'); END $$",
)


# router_outbox without its index of transaction units (0019), which every row pays for on
# MariaDB (no partial indexes) and only ``atomic`` targets read.
MYSQL_NOUNIT = (
    "CREATE TABLE nounit_outbox LIKE router_outbox",
    "ALTER TABLE nounit_outbox DROP KEY ix_router_outbox_unit",
)

_MYSQL_ORDER = "INSERT INTO orders (id, customer, total) VALUES (@n, 'c', 1.99)"
_MYSQL_KEY = "CONCAT('order-', @n)"
_MYSQL_COLUMNS = "message_id, target, destination, event_type, stream_key, envelope"
_MYSQL_ROW = f"UUID(), 'events', 'bench.order_placed', 'order_placed', {_MYSQL_KEY}, {{envelope}}"
_MYSQL_SLOT = f"router_streams WHERE stream_key = CAST(CRC32({_MYSQL_KEY}) & 1023 AS CHAR)"


def mysql_statements(payload: str, envelope: str) -> dict[str, str]:
    """Each part's outbox statement on MariaDB, the JSON texts as hex literals."""

    def literal(text: str) -> str:
        return f"CONVERT(X'{text.encode().hex()}' USING utf8mb4)"

    row, small = (_MYSQL_ROW.format(envelope=literal(t)) for t in (envelope, payload))
    into = f"INSERT INTO router_outbox ({_MYSQL_COLUMNS})"
    return {
        "hand": "INSERT INTO hand_outbox (id, target, type, `key`, payload) VALUES "
        f"(UUID(), 'events', 'order_placed', {_MYSQL_KEY}, {literal(payload)})",
        "table": f"{into} VALUES ({row})",
        "nounit": f"INSERT INTO nounit_outbox ({_MYSQL_COLUMNS}) VALUES ({row})",
        "small": f"{into} VALUES ({small})",
        "read": f"{into} SELECT {row} FROM {_MYSQL_SLOT}",
        "lock": f"{into} SELECT {row} FROM {_MYSQL_SLOT} FOR UPDATE",
        "apart": f"SELECT 1 FROM {_MYSQL_SLOT} FOR UPDATE;{into} VALUES ({row})",
    }


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
    end = "ROLLBACK" if args.rollback else "COMMIT"
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
                f"\\set n random(1, 9000000000000)\nBEGIN;\n{_ORDER}\n{statement}\n{end};\n"
            )
            scripts[part] = path
        async with _mysql.fresh_database("postgresql", "write_parts") as url:
            create_tables("postgresql", url)
            with psycopg.connect(url, autocommit=True) as conn:
                for statement in FLAT:
                    conn.execute(statement)
            for round_ in range(args.rounds):
                for writers in args.writers:
                    shift = round_ % len(args.parts)
                    order_ = args.parts[shift:] + args.parts[:shift]
                    for part in order_:
                        rate = await asyncio.to_thread(
                            run, pgbench, url, scripts[part], writers, args.seconds, defines
                        )
                        runs.setdefault((writers, part), []).append(rate)
                        print(
                            f"  round {round_ + 1} K={writers} {part}: {rate:,.0f} tps", flush=True
                        )
    return ratios(args.writers, args.parts, runs)


def slap(database: str, transaction: str, writers: int, transactions: int) -> float:
    """Transactions per second of one mariadb-slap run of ``transactions`` over ``writers``."""
    server = urlsplit(_mysql.MYSQL_ADMIN)
    login = [f"--user={server.username or 'root'}", f"--host={server.hostname or '127.0.0.1'}"]
    login += [f"--port={server.port or 3306}"]
    if server.password:
        login.append(f"--password={server.password}")
    statements = transaction.count(";") + 1
    command = ["mariadb-slap", *login, f"--create-schema={database}", f"--query={transaction}"]
    command += ["--delimiter=;", f"--concurrency={writers}", "--iterations=1"]
    command.append(f"--number-of-queries={transactions * statements}")
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - started
    found = re.search(r"Average number of seconds to run all queries: ([\d.]+)", done.stdout)
    if found is None or done.returncode:
        raise RuntimeError(f"mariadb-slap failed: {(done.stderr or done.stdout)[-800:]}")
    # slap's own time leaves out its connecting; it rounds to ms, so a short run falls back.
    return transactions / (float(found.group(1)) or elapsed)


async def measure_mysql(args: argparse.Namespace) -> dict[str, Any]:
    """``measure`` on MariaDB, by mariadb-slap."""
    payload, envelope = texts()
    end = "ROLLBACK" if args.rollback else "COMMIT"
    transactions = {
        part: f"START TRANSACTION;SET @n = UUID_SHORT();{_MYSQL_ORDER};{statement};{end}"
        for part, statement in mysql_statements(payload, envelope).items()
    }
    runs: dict[tuple[int, str], list[float]] = {}
    async with _mysql.fresh_database("mysql", "write_parts") as url:
        create_tables("mysql", url)
        conn = await _mysql.connect(url)
        try:
            async with conn.cursor() as cursor:
                for statement in MYSQL_NOUNIT:
                    await cursor.execute(statement)
        finally:
            await conn.ensure_closed()
        database = urlsplit(url).path.lstrip("/")
        for round_ in range(args.rounds):
            for writers in args.writers:
                shift = round_ % len(args.parts)
                for part in args.parts[shift:] + args.parts[:shift]:
                    rate = await asyncio.to_thread(
                        slap, database, transactions[part], writers, args.transactions
                    )
                    runs.setdefault((writers, part), []).append(rate)
                    print(f"  round {round_ + 1} K={writers} {part}: {rate:,.0f} tps", flush=True)
    return ratios(args.writers, args.parts, runs)


def ratios(
    writers: list[int], parts: tuple[str, ...], runs: dict[tuple[int, str], list[float]]
) -> dict[str, Any]:
    """Per K: hand's transactions/s, and each part's ratio to it round by round."""
    figures: dict[str, Any] = {}
    for k in writers:
        hand = runs[(k, "hand")]
        point: dict[str, Any] = {"hand_tps": spread(hand)}
        for part in parts[1:]:
            point[part] = spread([r / h for r, h in zip(runs[(k, part)], hand, strict=True)], 3)
        figures[str(k)] = point
    return figures


def main() -> None:
    """Measure, print, save."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database", choices=_mysql.DATABASES, default="postgresql")
    parser.add_argument("--writers", type=numbers, default=[1, 8, 32])
    parser.add_argument("--seconds", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--transactions", type=int, default=4000, help="MariaDB: transactions a point"
    )
    parser.add_argument(
        "--rollback", action="store_true", help="end each transaction with ROLLBACK (no flush)"
    )
    parser.add_argument(
        "--parts", type=lambda text: text.split(","), help="only these parts (hand always)"
    )
    parser.add_argument(
        "--output", help="bench/results/OUTPUT.json (write-parts[-mysql][-rollback] by default)"
    )
    args = parser.parse_args()
    mysql = args.database == "mysql"
    known = MYSQL_PARTS if mysql else PARTS
    unknown = set(args.parts or ()) - set(known)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; the parts: {', '.join(known)}")
    args.parts = tuple(p for p in known if p == "hand" or not args.parts or p in args.parts)
    figures = asyncio.run(measure_mysql(args) if mysql else measure(args))
    parts = args.parts
    tool = (
        f"mariadb-slap, {args.transactions:,} transactions a point"
        if mysql
        else f"pgbench, {args.seconds:g} s a point"
    )
    if args.rollback:
        tool += ", rolled back"

    def cell(f: dict[str, Any]) -> str:
        return f"{f['median']:.2f} ({f['min']:.2f}-{f['max']:.2f})"

    print_table(
        f"write_parts: {tool}, an orders row and an outbox row a transaction; each part over "
        f"hand, median (lowest-highest) of {args.rounds} rounds",
        ["K", "hand tps", *parts[1:]],
        [
            [k, f"{p['hand_tps']['median']:,.0f}", *(cell(p[part]) for part in parts[1:])]
            for k, p in figures.items()
        ],
    )
    parameters: dict[str, Any] = {"database": args.database, "writers": args.writers}
    parameters |= {"rounds": args.rounds, "rollback": args.rollback, "parts": list(parts)}
    parameters |= {"transactions": args.transactions} if mysql else {"seconds": args.seconds}
    if mysql:
        parameters["mysql_server"] = asyncio.run(_mysql.server_settings())
    output = args.output or "write-parts" + "-mysql" * mysql + "-rollback" * args.rollback
    print(f"written to {write_results(output, parameters, figures)}")


if __name__ == "__main__":
    main()
