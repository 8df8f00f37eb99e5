"""stage_sync: what SyncOutbox.stage() adds to a sync application's transaction.

    python -m bench.stage_sync [--transactions 3000] [--bulk-transactions 100] [--repeat 3]
                               [--driver psycopg|django|django-default|both]
                               [--output stage-sync] [--profile] [--cold-rounds 9]

``bench.stage``'s method on the sync writer, for three drivers, each on a fresh migrated
PostgreSQL database of its own: a raw psycopg 3 connection, and Django's connection (the
postgresql backend on psycopg 3, settings configured in-process) twice: ``django`` with
OPTIONS ``prepare_threshold`` 5, psycopg's own default, so a server-binding psycopg cursor on
Django's connection (stage()'s, a hand insert's) prepares, and ``django-default`` with
Django's defaults, where nothing is prepared (Django's cursors bind client-side in both).
``both`` runs all three. Each transaction is BEGIN, the rows, COMMIT (``with
conn.transaction()``; ``with transaction.atomic()``), written either by
``SyncOutbox.stage()`` (one statement with the NOTIFY and the stream-key lock; for the bulk,
one of the locks and the NOTIFY, then COPY) or by hand. The cases are ``bench.stage``'s: one
event per transaction with 1 and 3 targets, and keyed bulk, 1,000 events over 1,000 stream
keys, 1 target.

By hand, each event goes into the outbox a team would write itself (``bench._writers``' hand
outbox: uuid, target, type, key, jsonb payload, created_at, published_at; a partial index on
the pending rows), one row per target: a uuid4 and the event's JSON, by each hand-written
insert of ``bench._sync_inserts.HAND`` on the same connection: for one event, one prepared
``INSERT ... VALUES``; for the bulk, a prepared ``INSERT ... SELECT * FROM unnest(...)`` with
binary or text arrays, and ``COPY`` (which stage() itself uses there); on Django, on its
cursor and on a server-binding psycopg cursor of its connection (prepared only where Django's
settings let psycopg prepare). They all take turns with stage(), and the fastest of them
(lowest median of the rounds) is the baseline of its line; the others are printed under the
table. The hand inserts take no stream-key advisory lock and send no NOTIFY, and store the
event's JSON where stage() stores its envelope: those are what stage() adds. Each run checks
that every variant wrote its rows.

Variants take turns every block of transactions (50 single-event ones, 5 bulk ones), in
forward then reverse order, after an uncounted warm-up block of each; the drivers take turns
case by case in every round, each run on a new connection. The figures are the mean time per
transaction, the ratio of stage() to the baseline (median of the rounds' ratios, with the
lowest and highest) and the speed, baseline time over stage() time (the same per round, so
">= 0.9x its speed" reads directly).

Then, from process start (``--cold-rounds``, 9 by default; 0 skips it): new processes commit
one event each on psycopg 3, through ``SyncOutbox.from_file()`` and stage() or by the
strongest hand-written alternative (psycopg and pydantic only, a plain INSERT into the hand
outbox: ``bench._stage_sync_cold``), taking turns after one uncounted round. Per process: the
interpreter's start, the imports (and the config), the connect, the transaction, their sum
(to the first commit) and the exit, median and lowest-highest; and the speed to the first
commit, hand over stage(), per round.

``--profile`` measures where stage()'s time goes instead, per driver: cProfile of
``--transactions`` single-event transactions (1 target) through stage() (the top 10
functions by cumulative and by own time) and through the first hand insert; then, on that
case and on the keyed bulk, ``bench._sync_inserts.steps`` and the hand inserts in
interleaved rounds: stage()'s statement taken apart one piece at a time towards the hand
inserts, so each step's difference is what that piece costs. It writes ``OUTPUT-profile.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import functools
import json
import pstats
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
import yaml

from bench._common import (
    NATS_URL,
    ROOT,
    fresh_database,
    median,
    order,
    print_table,
    write_results,
)
from bench._sync_inserts import HAND, HandInsert, Step, steps
from bench._writers import create_tables
from bench.stage import BROKERS, BULK_EVENTS, CASES, Case, hand_rows, work
from router import Event, SyncOutbox
from router.write.staging import Stager
from tests.conftest import make_config

DRIVERS = ("psycopg", "django", "django-default")
# Django's database alias per driver: "default" with psycopg's prepare_threshold back,
# "plain" with Django's own settings (preparing off).
DJANGO_ALIASES = {"django": "default", "django-default": "plain"}
ROUTER = "stage()"
TARGET_SPEED = 0.9


@dataclass
class Session:
    """One driver's connection, as both variants use it."""

    driver: str
    connection: Any
    transaction: Callable[[], contextlib.AbstractContextManager[Any]]

    def scalar(self, query: str) -> Any:
        """One value, in a transaction of its own."""
        with self.transaction(), self.cursor() as cursor:
            cursor.execute(query)
            return cursor.fetchone()[0]

    def cursor(self) -> Any:
        """A cursor of the connection."""
        return self.connection.cursor()


@contextlib.contextmanager
def session(driver: str, url: str) -> Iterator[Session]:
    """A new connection of ``driver`` to ``url``; closed afterwards."""
    if driver == "psycopg":
        with psycopg.connect(url) as conn:
            yield Session(driver, conn, conn.transaction)
        return
    from django.db import DatabaseError, connections, transaction

    alias = DJANGO_ALIASES[driver]
    connection = connections[alias]
    if connection.settings_dict["NAME"] != urlsplit(url).path.lstrip("/"):
        raise RuntimeError(f"Django's {alias!r} is not {url}: configure_django() first")
    try:
        yield Session(driver, connection, functools.partial(transaction.atomic, using=alias))
    finally:
        with contextlib.suppress(DatabaseError):  # the server may have gone away
            connection.close()


def configure_django(urls: dict[str, str]) -> None:
    """Django's settings, in-process: a postgresql database per Django driver in ``urls``,
    nothing else (Django wants a "default" alias: the plain one's database if alone)."""
    import django
    from django.conf import settings

    databases = {
        DJANGO_ALIASES[driver]: django_database(url, prepare=driver == "django")
        for driver, url in urls.items()
        if driver in DJANGO_ALIASES
    }
    if not databases:
        return
    databases.setdefault("default", databases["plain"])
    settings.configure(DATABASES=databases)
    django.setup()


def django_database(url: str, *, prepare: bool) -> dict[str, Any]:
    """A ``DATABASES`` entry for ``url``; ``prepare``: psycopg's prepare_threshold back."""
    where = urlsplit(url)
    database: dict[str, Any] = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": where.path.lstrip("/"),
        "USER": where.username or "",
        "HOST": where.hostname or "",
        "PORT": str(where.port or 5432),
    }
    if prepare:
        # Django turns psycopg's prepared statements off (None); with psycopg's default back,
        # a server-binding psycopg cursor on Django's connection (stage()'s, the hand
        # insert's) prepares. Django's own cursors bind client-side and never prepare.
        database["OPTIONS"] = {"prepare_threshold": 5}
    return database


Variant = Callable[[Any, Sequence[Event], dict[str, Any]], None]


@dataclass
class Run:
    """One case on one driver: the variants (stage(), pieces of it, the hand inserts) and the
    seconds each spent."""

    session: Session
    outbox: SyncOutbox
    case: Case
    hand: dict[str, HandInsert]
    pieces: dict[str, Step] = field(default_factory=dict)
    variants: dict[str, Variant] = field(init=False)
    rows: int = 0

    def __post_init__(self) -> None:
        self.variants = {ROUTER: self.staged}
        for name, piece in self.pieces.items():
            self.variants[name] = functools.partial(self.stepped, piece)
        for name, insert in self.hand.items():
            self.variants[name] = functools.partial(self.by_hand, insert)

    def staged(self, connection: Any, events: Sequence[Event], options: dict[str, Any]) -> None:
        """Through stage()."""
        self.rows += len(self.outbox.stage(connection, *events, **options)) * self.case.targets

    def stepped(
        self, step: Step, connection: Any, events: Sequence[Event], options: dict[str, Any]
    ) -> None:
        """The rows stage() would write, built by its own stager, by a piece of stage()."""
        rows = self.outbox._stager.build_rows("main", events, **options)
        step(connection, rows)
        self.rows += len(rows)

    def by_hand(
        self,
        insert: HandInsert,
        connection: Any,
        events: Sequence[Event],
        options: dict[str, Any],
    ) -> None:
        """The events' hand outbox rows, one per target, by ``insert``."""
        rows = hand_rows(events, list(BROKERS[self.case.targets]), options)
        insert(connection, rows)
        self.rows += len(rows)

    def block(self, name: str, first: int, last: int, bulk: list[Event]) -> float:
        """Transactions ``first`` to ``last`` (excluded) by one variant; seconds spent."""
        variant, conn = self.variants[name], self.session.connection
        started = time.perf_counter()
        for i in range(first, last):
            events, options = work(self.case, i, bulk)
            with self.session.transaction():
                variant(conn, events, options)
        return time.perf_counter() - started


def run_case(
    driver: str,
    url: str,
    case: Case,
    transactions: int,
    hand: dict[str, HandInsert],
    where: str,
    repeated: list[str],
    pieces: dict[str, Step] | None = None,
) -> dict[str, float]:
    """``run_once``, run again from scratch if the server went away during it (listed in
    ``repeated``)."""
    for attempt in range(1, RUN_ATTEMPTS + 1):
        try:
            return run_once(driver, url, case, transactions, hand, pieces or {})
        except Exception as exc:
            if attempt == RUN_ATTEMPTS or not server_went_away(exc):
                raise
            repeated.append(f"{where}: {type(exc).__name__}: {exc}".strip())
            print(f"  {repeated[-1]}; repeating that run", flush=True)
            wait_for_server(url)
    raise AssertionError("unreachable")


ROWS = "SELECT (SELECT count(*) FROM router_outbox) + (SELECT count(*) FROM hand_outbox)"


def run_once(
    driver: str,
    url: str,
    case: Case,
    transactions: int,
    hand: dict[str, HandInsert],
    pieces: dict[str, Step],
) -> dict[str, float]:
    """Mean seconds per transaction of stage(), of each of its ``pieces`` and of each hand
    insert, taking turns every ``case.block`` transactions, on a new connection."""
    outbox = SyncOutbox(make_config({"main": url}, BROKERS[case.targets]))
    bulk = bulk_events() if case.bulk else []
    with session(driver, url) as s:
        run = Run(s, outbox, case, hand, pieces)
        names = list(run.variants)
        for name in names:  # warm-up: connection, prepared statements, route caches
            run.block(name, 0, case.block, bulk)
        if case.bulk:  # every round of the bulk case starts from the same, empty tables
            with s.transaction(), s.cursor() as cursor:
                cursor.execute("TRUNCATE router_outbox, hand_outbox")
        before, run.rows = s.scalar(ROWS), 0
        spent = dict.fromkeys(names, 0.0)
        for first in range(0, transactions, case.block):
            turn = names if (first // case.block) % 2 == 0 else names[::-1]
            for name in turn:
                last = min(first + case.block, transactions)
                spent[name] += run.block(name, first, last, bulk)
        written = s.scalar(ROWS) - before
        if written != run.rows:
            raise RuntimeError(f"{driver} {case.name}: {written:,} rows, expected {run.rows:,}")
    return {name: seconds / transactions for name, seconds in spent.items()}


@functools.cache
def bulk_events() -> list[Event]:
    """The bulk case's events, made once, outside the clock."""
    return [order(n) for n in range(BULK_EVENTS)]


Results = dict[tuple[str, str], list[float]]
"""Seconds per transaction of each round, by (case, variant)."""


def measure(urls: dict[str, str], args: argparse.Namespace) -> tuple[dict[str, Results], list[str]]:
    """Every round of every case on each driver, the drivers taking turns case by case; and
    the runs that were repeated because the server went away during them."""
    results: dict[str, Results] = {driver: {} for driver in urls}
    repeated: list[str] = []
    for round_ in range(args.repeat):
        for case in CASES:
            count = args.bulk_transactions if case.bulk else args.transactions
            for driver, url in urls.items():
                where = f"round {round_ + 1}/{args.repeat} {driver} {case.name}"
                started = time.perf_counter()
                pair = run_case(
                    driver, url, case, count, HAND[(driver, case.bulk)], where, repeated
                )
                for name, seconds in pair.items():
                    results[driver].setdefault((case.name, name), []).append(seconds)
                print(f"  {where}: {time.perf_counter() - started:.1f} s", flush=True)
    return results, repeated


RUN_ATTEMPTS = 5
"""Tries per run: the server is shared, and other work restarts it now and then."""


def server_went_away(exc: BaseException) -> bool:
    """Whether psycopg lost the server somewhere in ``exc``'s chain (Django wraps it)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, psycopg.OperationalError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def wait_for_server(url: str, seconds: float = 300) -> None:
    """Until a connection to ``url`` succeeds again."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            psycopg.connect(url).close()
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def summarise(driver: str, case: Case, results: Results) -> dict[str, Any]:
    """One line's figures: the baseline (the fastest hand insert), stage(), their ratios."""
    rounds = {name: results[(case.name, name)] for name in (ROUTER, *HAND[(driver, case.bulk)])}
    candidates = {name: median(r) * 1e6 for name, r in rounds.items() if name != ROUTER}
    baseline = min(candidates, key=candidates.__getitem__)
    ratios = [s / h for s, h in zip(rounds[ROUTER], rounds[baseline], strict=True)]
    speeds = [h / s for s, h in zip(rounds[ROUTER], rounds[baseline], strict=True)]
    return {
        "baseline": baseline,
        "by_hand_us": round(candidates[baseline], 1),
        "stage_us": round(median(rounds[ROUTER]) * 1e6, 1),
        "ratio": round(median(ratios), 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
        "speed": round(median(speeds), 3),
        "speed_min": round(min(speeds), 3),
        "speed_max": round(max(speeds), 3),
        "meets_target": median(speeds) >= TARGET_SPEED,
        "candidates_us": {name: round(us, 1) for name, us in candidates.items()},
        "rounds_us": {name: [round(s * 1e6, 1) for s in r] for name, r in rounds.items()},
    }


def label(case: Case) -> str:
    """The case as the table names it."""
    if case.bulk:
        return f"keyed bulk ({BULK_EVENTS:,} events, {BULK_EVENTS:,} keys)"
    return f"1 event, {case.targets} target{'s' if case.targets > 1 else ''}"


def report(figures: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    """The table, then every hand candidate's median."""
    header = ["driver", "case", "baseline (fastest by hand)", "hand us/tx", "stage() us/tx"]
    header += ["ratio", "ratio range", "speed", "speed range", f">= {TARGET_SPEED}x"]
    rows = []
    for driver, cases in figures.items():
        for case in CASES:
            f = cases[case.name]
            rows.append(
                [
                    driver,
                    label(case),
                    f["baseline"],
                    f"{f['by_hand_us']:,.0f}",
                    f"{f['stage_us']:,.0f}",
                    f"{f['ratio']:.2f}x",
                    f"{f['ratio_min']:.2f}-{f['ratio_max']:.2f}x",
                    f"{f['speed']:.2f}x",
                    f"{f['speed_min']:.2f}-{f['speed_max']:.2f}x",
                    "yes" if f["meets_target"] else "no",
                ]
            )
    print_table(
        f"stage_sync: SyncOutbox.stage() against the fastest hand insert, median of "
        f"{args.repeat} rounds x {args.transactions:,} transactions "
        f"({args.bulk_transactions:,} keyed bulk ones)",
        header,
        rows,
    )
    print(
        "  ratio: stage() time / hand time; speed: hand time / stage() time (per round, median"
        "\n  and lowest-highest). By hand: a plain outbox table of the team's own, one row per"
        "\n  target (uuid4, the event's JSON), no stream-key lock, no NOTIFY, no envelope."
    )
    print("  hand inserts measured (us/tx, median of the rounds; the fastest is the baseline):")
    for driver, cases in figures.items():
        for case in CASES:
            listed = ", ".join(
                f"{n} {us:,.0f}" for n, us in cases[case.name]["candidates_us"].items()
            )
            print(f"    {driver}, {label(case)}: {listed}")


def server_settings(url: str) -> dict[str, Any]:
    """What decides a commit's cost on the server, and the client libraries' versions."""
    import django

    with psycopg.connect(url) as conn:
        shown = {
            name: conn.execute(f"SHOW {name}").fetchone()[0]  # type: ignore[index]
            for name in ("server_version", "fsync", "synchronous_commit", "wal_sync_method")
        }
    return {
        **shown,
        "psycopg": psycopg.__version__,
        "psycopg_impl": psycopg.pq.__impl__,
        "libpq": psycopg.pq.version(),
        "django": django.__version__,
    }


def profile(driver: str, url: str, transactions: int) -> dict[str, Any]:
    """cProfile of stage() and of a hand insert, one event per transaction with 1 target."""
    case = CASES[0]
    outbox = SyncOutbox(make_config({"main": url}, BROKERS[case.targets]))
    figures: dict[str, Any] = {}
    with session(driver, url) as s:
        run = Run(s, outbox, case, HAND[(driver, False)])
        for name in (ROUTER, next(iter(run.hand))):
            run.block(name, 0, case.block, [])
            profiler = cProfile.Profile()
            profiler.enable()
            run.block(name, 0, transactions, [])
            profiler.disable()
            entries = [
                (f"{short(path)}:{line}({function})", calls, own, cumulative)
                for (path, line, function), (_, calls, own, cumulative, _) in pstats.Stats(
                    profiler
                ).stats.items()  # type: ignore[attr-defined]
            ]
            total = sum(own for _, _, own, _ in entries) / transactions * 1e6
            # psycopg's wait() runs the query's generator; its own time is the C part: libpq
            # sending and receiving, and blocking on the socket until the server answers.
            blocked = sum(
                own
                for where, _, own, _ in entries
                if where.startswith("psycopg/connection.py:") and where.endswith("(wait)")
            )
            blocked = blocked / transactions * 1e6
            print(
                f"{driver}, {label(case)}, {name}: {total:,.0f} us/tx under cProfile "
                f"({transactions:,} transactions), {blocked:,.0f} of them in psycopg's "
                f"Connection.wait (the server, the network, libpq), {total - blocked:,.0f} in "
                "Python"
            )
            figures[name] = {"us_per_tx": round(total, 1), "wait_us_per_tx": round(blocked, 1)}
            if name == ROUTER:
                mine = [e for e in entries if not e[0].startswith("bench/")]
                figures[name]["top_cumulative"] = print_top("cumulative", mine, lambda e: e[3])
                figures[name]["top_own"] = print_top("own", mine, lambda e: e[2])
    return figures


def ladder(
    driver: str, url: str, case: Case, args: argparse.Namespace, repeated: list[str]
) -> dict[str, Any]:
    """stage() and ``steps`` on one case, in interleaved rounds: what each piece of stage()
    costs."""
    stager = Stager(make_config({"main": url}, BROKERS[case.targets]))
    count = args.bulk_transactions if case.bulk else args.transactions
    hand = HAND[(driver, case.bulk)]
    rounds: dict[str, list[float]] = {}
    for round_ in range(args.repeat):
        where = f"steps, round {round_ + 1}/{args.repeat} {driver} {case.name}"
        pieces = steps(stager)
        run = run_case(driver, url, case, count, hand, where, repeated, pieces)
        for name, seconds in run.items():
            shown = f"hand: {name}" if name in hand else name
            rounds.setdefault(shown, []).append(seconds * 1e6)
    rows, figures, previous = [], {}, None
    for name, us in rounds.items():
        middle = median(us)
        step = "" if previous is None else f"{previous - middle:,.0f}"
        rows.append([name, f"{middle:,.0f}", f"{min(us):,.0f}-{max(us):,.0f}", step])
        figures[name] = {"us_per_tx": round(middle, 1), "rounds_us": [round(u, 1) for u in us]}
        if not name.startswith("hand: "):  # each hand insert against the last step
            previous = middle
    print_table(
        f"{driver}, {label(case)}: stage() taken apart, median of {args.repeat} rounds x "
        f"{count:,} transactions, taking turns",
        ["variant", "us/tx", "rounds", "saved by the step"],
        rows,
    )
    return figures


Entry = tuple[str, int, float, float]
"""A profiled function: where, calls, own and cumulative seconds."""


def print_top(
    what: str, entries: list[Entry], key: Callable[[Entry], float]
) -> list[dict[str, Any]]:
    """Print the 10 entries with the most ``key`` time; return them."""
    top = sorted(entries, key=key, reverse=True)[:10]
    rows = [
        [where, f"{calls:,}", f"{own * 1e3:,.0f}", f"{cumulative * 1e3:,.0f}"]
        for where, calls, own, cumulative in top
    ]
    print_table(f"  top 10 by {what} time", ["function", "calls", "own ms", "cumulative ms"], rows)
    return [
        {"function": w, "calls": c, "own_s": round(o, 3), "cumulative_s": round(u, 3)}
        for w, c, o, u in top
    ]


def short(path: str) -> str:
    """A path from site-packages or the repository root."""
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1]
    with contextlib.suppress(ValueError):
        return str(Path(path).relative_to(ROOT))
    return path


COLD = ROOT / "bench" / "_stage_sync_cold.py"
COLD_STEPS = ("interpreter", "imports", "connect", "transaction", "first_commit", "exit")


def cold_start(url: str, rounds: int) -> dict[str, Any]:
    """From process start: a new process commits one event through stage(), or by hand
    (``bench._stage_sync_cold``), the two taking turns for ``rounds`` rounds after one
    uncounted round. Per process, in ms: the interpreter's start (the bench's clock before
    the spawn to the script's first line), the imports (and, for stage(), loading the
    config), the connect, the transaction, the sum of these (to the first commit) and the
    interpreter's exit."""
    samples: dict[str, list[dict[str, float]]] = {"stage": [], "hand": []}
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "config.yaml"
        brokers = {
            "events": {
                "type": "nats",
                "url": NATS_URL,
                "internal": True,
                "destination": "shop.{event_type}",
                "stream": {"name": "SHOP", "subjects": ["shop.>"]},
            }
        }
        config.write_text(
            yaml.safe_dump({"service": "shop", "databases": {"main": url}, "brokers": brokers})
        )
        for round_ in range(rounds + 1):
            for variant in ("stage", "hand") if round_ % 2 == 0 else ("hand", "stage"):
                before = time.time()
                done = subprocess.run(
                    [sys.executable, str(COLD), variant, url, str(config)],
                    capture_output=True,
                    text=True,
                    check=True,
                    cwd=folder,
                )
                exited = time.time()
                marks = json.loads(done.stdout)
                if round_ == 0:
                    continue  # the page cache's warm-up
                samples[variant].append(
                    {
                        "interpreter": marks["started"] - before,
                        "imports": marks["imported"] - marks["started"],
                        "connect": marks["connected"] - marks["imported"],
                        "transaction": marks["committed"] - marks["connected"],
                        "first_commit": marks["committed"] - before,
                        "exit": exited - marks["committed"],
                    }
                )
    figures: dict[str, Any] = {"rounds": rounds}
    for variant, runs in samples.items():
        figures[variant] = {
            step: {
                "median_ms": round(median([r[step] for r in runs]) * 1e3, 1),
                "min_ms": round(min(r[step] for r in runs) * 1e3, 1),
                "max_ms": round(max(r[step] for r in runs) * 1e3, 1),
            }
            for step in COLD_STEPS
        }
    speeds = [
        h["first_commit"] / s["first_commit"]
        for s, h in zip(samples["stage"], samples["hand"], strict=True)
    ]
    figures["speed"] = round(median(speeds), 3)
    figures["speed_min"] = round(min(speeds), 3)
    figures["speed_max"] = round(max(speeds), 3)
    return figures


def report_cold(cold: dict[str, Any]) -> None:
    """The from-process-start table."""
    rows = []
    for variant, name in (("stage", ROUTER), ("hand", "by hand (psycopg + pydantic)")):
        f = cold[variant]
        rows.append(
            [name]
            + [
                f"{f[step]['median_ms']:,.0f} ({f[step]['min_ms']:,.0f}-{f[step]['max_ms']:,.0f})"
                for step in COLD_STEPS
            ]
        )
    print_table(
        f"stage_sync from process start: one event committed by a new process, psycopg 3, "
        f"median (lowest-highest) ms of {cold['rounds']} rounds",
        ["variant", *COLD_STEPS],
        rows,
    )
    print(
        f"  speed to the first commit, hand time / stage() time: {cold['speed']:.2f}x "
        f"({cold['speed_min']:.2f}-{cold['speed_max']:.2f}x). The imports are the router's"
        "\n  own and pydantic's; stage() also loads config.yaml and asks once whether the"
        "\n  router's tables are there."
    )


def main() -> None:
    """Measure (or profile), print, save."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transactions", type=int, default=3000)
    parser.add_argument("--bulk-transactions", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--driver",
        choices=[*DRIVERS, "both"],
        default="both",
        help="both: psycopg, and Django with and without prepared statements",
    )
    parser.add_argument("--output", default="stage-sync", help="bench/results/OUTPUT.json")
    parser.add_argument("--profile", action="store_true", help="profile stage() instead")
    parser.add_argument(
        "--cold-rounds",
        type=int,
        default=9,
        help="rounds of new processes committing one event each, from process start (0: none)",
    )
    args = parser.parse_args()
    drivers = DRIVERS if args.driver == "both" else (args.driver,)

    with asyncio.Runner() as runner, contextlib.ExitStack() as stack:

        def fresh(driver: str) -> str:
            database = fresh_database(f"stage_sync_{driver}")
            url = runner.run(database.__aenter__())
            stack.push(lambda *exc: runner.run(database.__aexit__(*exc)))
            create_tables("postgresql", url)  # the hand outbox
            return url

        urls = {driver: fresh(driver) for driver in drivers}
        configure_django(urls)
        parameters = {
            "transactions": args.transactions,
            "bulk_transactions": args.bulk_transactions,
            "bulk_events": BULK_EVENTS,
            "blocks": {case.name: case.block for case in CASES},
            "repeat": args.repeat,
            "drivers": list(drivers),
            "target_speed": TARGET_SPEED,
            "server": server_settings(urls[drivers[0]]),
        }
        if args.profile:
            figures: dict[str, Any] = {
                driver: {"profile": profile(driver, url, args.transactions)}
                for driver, url in urls.items()
            }
            repeated: list[str] = []
            for driver, url in urls.items():
                figures[driver]["steps"] = {
                    case.name: ladder(driver, url, case, args, repeated)
                    for case in (CASES[0], CASES[-1])
                }
            parameters["repeated_runs"] = repeated
            output = f"{args.output}-profile"
        else:
            results, repeated = measure(urls, args)
            parameters["repeated_runs"] = repeated
            output = args.output
            cold = None
            if args.cold_rounds:
                parameters["cold_rounds"] = args.cold_rounds
                cold = cold_start(urls.get("psycopg") or fresh("psycopg"), args.cold_rounds)

    if not args.profile:
        figures = {
            driver: {case.name: summarise(driver, case, results[driver]) for case in CASES}
            for driver in drivers
        }
        report(figures, args)
        if cold is not None:
            report_cold(cold)
            figures["from_process_start"] = cold
    path = write_results(output, parameters, figures)
    print(f"written to {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
