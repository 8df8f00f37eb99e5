"""One drain of a fresh backlog by a relay started as a process of its own, timed from exec.

A drain stages ``events`` events in a fresh PostgreSQL database (the real write path:
transactions of 100 events, 4 per order id as stream key) and makes a fresh JetStream
stream, then starts the relay (``router serve`` or ``python -m bench.baseline``) and reads
back, from the stream, when JetStream stored the first and the last message. Figures:

- from exec: events over the time from the bench's clock read just before the process is
  spawned to the last message stored, so the relay's start (interpreter, imports,
  connections, the first claim) is part of it, as it is for a user;
- first to last: events over the time between the first and the last message stored;
- PostgreSQL CPU per delivered row (see ``postgres_cpu_ticks``), from just before exec to
  once the relay has exited and its connections are gone;
- the relay's own CPU per delivered row (its process and every worker it forked, from the
  kernel's accounting once they are reaped: start-up included), and the NATS server's over
  the same span. With PostgreSQL's, that is where the machine's two cores went;
- the WAL PostgreSQL wrote per delivered row over the same span (server-wide: its insert
  position before exec and once the relay's connections are gone): what each row costs the
  disk, a replica and the checkpoints that follow.
"""

from __future__ import annotations

import asyncio
import compileall
import contextlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import IO, Any

import asyncpg
import nats
import yaml
from nats.js.api import StorageType

from bench._common import (
    ADMIN_DSN,
    NATS_URL,
    ROOT,
    Stream,
    fresh_database,
    fresh_stream,
    order,
    router_config,
    wait_for_count,
)
from router import Outbox
from tests.conftest import make_config

__all__ = [
    "BATCH",
    "HELD_BASELINE",
    "PER_ORDER",
    "PER_TRANSACTION",
    "drain",
    "stage_backlog",
    "transactions",
]

PER_ORDER = 4
PER_TRANSACTION = 100
BATCH = 500
CLK_TCK = os.sysconf("SC_CLK_TCK")


async def stage_backlog(
    url: str, stream: Stream, events: int, brokers: dict[str, Any] | None = None
) -> None:
    """``events`` events through Outbox.stage, as an application would have written them."""
    internal = {
        "type": "nats",
        "internal": True,
        "destination": stream.destination,
        "stream": {"name": stream.name, "subjects": [stream.subject + ".>"]},
    }
    outbox = Outbox(make_config({"main": url}, brokers or {"events": internal}))
    async with transactions(outbox, url) as transaction:
        for start in range(0, events, PER_TRANSACTION):
            async with transaction() as conn:
                for first in range(start, min(start + PER_TRANSACTION, events), PER_ORDER):
                    await outbox.stage(
                        conn,
                        *(order(i) for i in range(first, min(first + PER_ORDER, events))),
                        stream_key=f"order-{first // PER_ORDER}",
                    )


@contextlib.asynccontextmanager
async def transactions(
    outbox: Outbox, url: str
) -> AsyncIterator[Callable[[], contextlib.AbstractAsyncContextManager[Any]]]:
    """What opens a producer's transactions: a raw asyncpg connection's on PostgreSQL, a
    SQLAlchemy engine's on MariaDB (each yields what ``stage()`` takes)."""
    if url.startswith("mysql"):
        try:
            yield outbox.engine().begin
        finally:
            await outbox.close()
        return
    conn = await asyncpg.connect(url)

    @contextlib.asynccontextmanager
    async def transaction() -> AsyncIterator[Any]:
        async with conn.transaction():
            yield conn

    try:
        yield transaction
    finally:
        await conn.close()


def postgres_cpu_ticks() -> int:
    """CPU time (clock ticks) of every process named ``postgres*`` on the machine, including
    its reaped children's: a backend that exits between two readings is no longer listed, and
    its time then sits in the postmaster's cutime + cstime, which the sum takes in."""
    return cpu_ticks("postgres")


def nats_cpu_ticks() -> int:
    """CPU time (clock ticks) of the NATS server processes on the machine."""
    return cpu_ticks("nats-server")


def cpu_ticks(name: str) -> int:
    """utime + stime + cutime + cstime of every process whose name starts with ``name``."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            text = stat.read_text()
            if text[text.index("(") + 1 :].startswith(name):
                fields = text.rsplit(")", 1)[1].split()
                total += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    return total


async def wal_position() -> int:
    """PostgreSQL's WAL insert position, in bytes."""
    admin = await asyncpg.connect(ADMIN_DSN)
    try:
        lsn: str = await admin.fetchval("SELECT pg_current_wal_insert_lsn()::text")
    finally:
        await admin.close()
    high, low = lsn.split("/")
    return (int(high, 16) << 32) + int(low, 16)


def children_cpu_seconds() -> float:
    """User + system CPU of this process's reaped children (and theirs, once reaped)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def backends_gone(database: str, timeout: float = 10) -> None:
    """Wait until no server process serves ``database``, so every backend's time has reached
    its parent's count."""
    deadline = time.monotonic() + timeout
    while serving(database) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def serving(database: str) -> bool:
    """Whether a backend of ``database`` runs (from /proc: asking the server costs it CPU)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if f" {database} ".encode() in cmdline.read_bytes():
                return True
    return False


class Relay:
    """A relay process in its own process group, started now; the group is killed on exit."""

    def __init__(self, argv: Sequence[str], folder: Path, cwd: Path, *, exits: bool) -> None:
        self.exits = exits  # stops by itself once the outbox is empty
        self.path = folder / "relay.log"
        self.log: IO[str] = self.path.open("w")
        self.exec_at = time.time()
        self.process = subprocess.Popen(
            argv, cwd=cwd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def tail(self) -> str:
        """The end of its output, for an error message."""
        if not self.log.closed:
            self.log.flush()
        return "\n".join(self.path.read_text().splitlines()[-20:])

    def stop(self) -> int:
        """The exit status: the baseline is waited for (it marks its last batch, claims
        nothing and exits); ``router serve`` gets SIGTERM (it stops gracefully, marking what
        it sent). Then SIGKILL to whatever is left of the group."""
        if self.exits:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.log.close()
        return self.process.wait()


PLAIN_TABLE = "0010"
"""The baselines' schema: the outbox as one plain table, before it was partitioned (0011). A
hand relay's claim and mark are fastest there (on the partitioned table its mark, by seq
alone, searches every partition), and the baseline is the strongest relay we can write."""

HELD_BASELINE = -1
"""The worker count that stands for ``bench.baseline --hold`` (0: the baseline)."""


def start(workers: int, url: str, events: int, folder: Path) -> Relay:
    """``router serve --workers N`` on the config in ``folder``, or the baseline (N = 0;
    ``HELD_BASELINE``: the baseline with ``--hold``)."""
    if workers > 0:
        router = str(Path(sys.executable).with_name("router"))
        level = os.environ.get("BENCH_ROUTER_LOG_LEVEL", "warning")
        argv = [router, "--log-level", level, "serve", "--workers", str(workers)]
        return Relay(argv, folder, cwd=folder, exits=False)
    argv = [sys.executable, "-m", "bench.baseline", "--dsn", url, "--nats", NATS_URL]
    argv += ["--batch", str(BATCH), "--events", str(events)]
    if workers == HELD_BASELINE:
        argv.append("--hold")
    return Relay(argv, folder, cwd=ROOT, exits=True)


async def drain(workers: int, storage: StorageType, events: int) -> dict[str, float]:
    """One drain by ``router serve --workers N`` (or the baseline for 0) of a fresh backlog."""
    folder = Path(tempfile.mkdtemp(prefix="drain-"))
    try:
        revision = "head" if workers > 0 else PLAIN_TABLE
        async with (
            fresh_database("drain", revision) as url,
            fresh_stream("drain", storage) as stream,
        ):
            await stage_backlog(url, stream, events)
            # The router checks the stream at start (create on, as users run it).
            config = router_config(url, stream, create=True, batch_size=BATCH)
            (folder / "config.yaml").write_text(yaml.safe_dump(config))
            database = url.rsplit("/", 1)[1]
            await backends_gone(database)
            wal_before = await wal_position()
            cpu_before, nats_before = postgres_cpu_ticks(), nats_cpu_ticks()
            relay_before = children_cpu_seconds()
            relay = start(workers, url, events, folder)
            try:
                first, last = await stored(relay, stream, events)
            finally:
                status = relay.stop()
            relay_cpu = children_cpu_seconds() - relay_before
            nats_cpu = nats_cpu_ticks() - nats_before
            await backends_gone(database)
            cpu = postgres_cpu_ticks() - cpu_before
            wal = await wal_position() - wal_before
            await check_published(url, events, relay, None if workers > 0 else status)
            size = await stream_bytes(stream)
    finally:
        if "BENCH_ROUTER_LOG_LEVEL" not in os.environ:  # else its relay.log is kept to read
            shutil.rmtree(folder, ignore_errors=True)
    return {
        "from_exec": events / (last - relay.exec_at),
        "first_to_last": events / (last - first) if last > first else float("inf"),
        "pg_cpu_us_per_row": cpu / CLK_TCK * 1e6 / events,
        "relay_cpu_us_per_row": relay_cpu * 1e6 / events,
        "nats_cpu_us_per_row": nats_cpu / CLK_TCK * 1e6 / events,
        "bytes_per_message": size / events,
        "wal_bytes_per_row": wal / events,
    }


async def stored(relay: Relay, stream: Stream, events: int) -> tuple[float, float]:
    """When JetStream stored the first and the last event; fails soon if the relay exits
    without having delivered them all."""
    waiting = asyncio.create_task(wait_for_count(stream, events, timeout=600))
    exited_at: float | None = None
    while not waiting.done():
        if relay.process.poll() is not None:
            # The baseline exits once done: its last messages may be a poll away.
            exited_at = exited_at or time.monotonic()
            if time.monotonic() - exited_at > 3:
                waiting.cancel()
                raise RuntimeError(f"relay exited with {relay.process.returncode}:\n{relay.tail()}")
        await asyncio.wait({waiting}, timeout=0.2)
    return waiting.result()


async def check_published(url: str, events: int, relay: Relay, status: int | None) -> None:
    """Every row marked published, and the baseline's ``status`` 0 (it checks its count)."""
    conn = await asyncpg.connect(url)
    try:
        published = await conn.fetchval(
            "SELECT count(*) FROM router_outbox WHERE status = 'published'"
        )
    finally:
        await conn.close()
    if published != events:
        raise RuntimeError(f"{published} of {events} rows marked published:\n{relay.tail()}")
    if status not in (None, 0):
        raise RuntimeError(f"baseline exited with {status}:\n{relay.tail()}")


async def stream_bytes(stream: Stream) -> int:
    """What the stream stores, in bytes (messages with headers and JetStream's framing)."""
    client = await nats.connect(NATS_URL)
    try:
        return int((await client.jetstream().stream_info(stream.name)).state.bytes)
    finally:
        await client.close()


def compile_bytecode() -> None:
    """Compile the relays' modules, as pip does on install, so no start compiles a module
    (a checkout run with PYTHONDONTWRITEBYTECODE=1 would at every start)."""
    for package in ("router", "brokers", "envelopes", "bench"):
        compileall.compile_dir(ROOT / package, quiet=1)
