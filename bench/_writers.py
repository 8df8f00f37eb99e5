"""The writers of ``bench.write_concurrency``: K connections of one client committing flat
out, each transaction one business row and one event, written by hand or by stage().

Per client, the strongest hand-written outbox a team would write for it: a plain table
(uuid, target, type, key, JSON, created_at, published_at; an index on the pending rows), one
INSERT, prepared where the driver prepares (psycopg ``prepare=True``; asyncpg prepares and
caches every statement; PyMySQL binds client-side and prepares nothing, as for stage()).
``hand+notify`` (PostgreSQL) is the same INSERT with a ``pg_notify`` folded in, so it costs
the NOTIFY and no extra round trip, as stage() folds its own in.

The hand outbox (``create_tables``, ``hand_row``, ``hand_insert``) is every write-path
benchmark's baseline: ``bench.stage``, ``bench.stage_sync``, ``bench.whole_system`` and
``bench.gate`` write it too.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import asyncpg
import psycopg
import sqlalchemy
import uvloop

from bench._common import order
from router import Event, Outbox, SyncOutbox

__all__ = [
    "CLIENTS",
    "MODES",
    "Client",
    "HandRow",
    "SyncClient",
    "create_tables",
    "hand_insert",
    "hand_row",
    "make_client",
]

CLIENTS = ("psycopg", "asyncpg", "mysql")
KIND = {"psycopg": "postgresql", "asyncpg": "postgresql", "mysql": "mysql"}
MODES = {
    "postgresql": ("hand", "hand+notify", "stage"),
    "mysql": ("hand", "stage"),
}
TARGET = "events"

PG_TABLES = """
CREATE TABLE IF NOT EXISTS orders (
    id bigint PRIMARY KEY, customer text NOT NULL, total numeric(12, 2) NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE IF NOT EXISTS hand_outbox (
    id uuid PRIMARY KEY, target text NOT NULL, type text NOT NULL, key text,
    payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz);
CREATE INDEX IF NOT EXISTS hand_outbox_pending ON hand_outbox (created_at)
    WHERE published_at IS NULL;
"""
MYSQL_TABLES = (
    "CREATE TABLE IF NOT EXISTS orders (id BIGINT PRIMARY KEY, customer VARCHAR(64) NOT NULL, "
    "total DECIMAL(12, 2) NOT NULL, created_at DATETIME(6) NOT NULL DEFAULT NOW(6))",
    # MariaDB has no partial index: the pending rows are the ones with a NULL published_at.
    "CREATE TABLE IF NOT EXISTS hand_outbox (id UUID PRIMARY KEY, target VARCHAR(64) NOT NULL, "
    "type VARCHAR(128) NOT NULL, `key` VARCHAR(255), payload JSON NOT NULL, "
    "created_at DATETIME(6) NOT NULL DEFAULT NOW(6), published_at DATETIME(6) NULL, "
    "KEY hand_outbox_pending (published_at, created_at))",
)

ORDER = "INSERT INTO orders (id, customer, total) VALUES (%s, %s, %s)"
HAND_INTO = "INSERT INTO hand_outbox (id, target, type, `key`, payload) VALUES "
HAND_ROW = "(%s, %s, %s, %s, %s)"
HAND = HAND_INTO + HAND_ROW
HAND_NOTIFY = (
    "INSERT INTO hand_outbox (id, target, type, key, payload) "
    "SELECT %s::uuid, %s, %s, %s, %s::jsonb FROM (SELECT pg_notify('x', %s)) AS notified"
)

_ids = itertools.count(1)  # order ids, unique in the process (next() is atomic in CPython)


def _pg(sql: str) -> str:
    return sql.replace("`", "")


@functools.cache
def hand_insert(count: int, kind: str = "postgresql") -> str:
    """The hand outbox's INSERT of ``count`` rows (``hand_row``'s), ``%s`` placeholders."""
    sql = HAND_INTO + ", ".join([HAND_ROW] * count)
    return _pg(sql) if kind == "postgresql" else sql


def _numbered(sql: str) -> str:
    """psycopg's ``%s`` placeholders as asyncpg's ``$1, $2, ...``."""
    parts = _pg(sql).split("%s")
    return "".join(f"{part}${n}" for n, part in enumerate(parts[:-1], 1)) + parts[-1]


HandRow = tuple[uuid.UUID, str, str, str | None, str]
"""A hand outbox row's parameters: id, target, type, key, payload (JSON text)."""


def hand_row(event: Event, target: str, key: str | None) -> HandRow:
    """What a team's own outbox stores for an event: a fresh uuid4, the target, the type,
    the stream key and the event's JSON as pydantic writes it."""
    return (uuid.uuid4(), target, type(event).__event__.type, key, event.model_dump_json())


def _business(event: Any, n: int) -> tuple[Any, ...]:
    """The business row's parameters for order ``n`` (``event``)."""
    return (n, event.customer, event.total)


def _hand(event: Event, n: int, notify: bool) -> tuple[Any, ...]:
    """The hand outbox row's parameters for order ``n``: built only by the hand modes, so
    that ``stage`` pays for its own row alone (the event is built once in every mode)."""
    key = f"order-{n}"
    row: tuple[Any, ...] = hand_row(event, TARGET, key)
    return row + ((key,) if notify else ())


@dataclass
class Client:
    """One client's way to run a point: K writers, one mode, flat out for some seconds."""

    name: str
    url: str
    config: Any
    kind: str = ""

    def __post_init__(self) -> None:
        self.kind = KIND[self.name]

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes this client's database has."""
        return MODES[self.kind]

    def point(self, mode: str, writers: int, seconds: float) -> float:
        """Commits/s of ``writers`` connections committing ``mode`` transactions."""
        raise NotImplementedError

    def run(self, mode: str, count: int, first: int) -> None:
        """``count`` transactions of ``mode`` on one connection, one after another, orders
        ``first`` on (what ``bench.stage_cpu`` counts the instructions of)."""
        raise NotImplementedError


class SyncClient(Client):
    """A client of threads: K connections, one a thread."""

    def point(self, mode: str, writers: int, seconds: float) -> float:
        transaction = self.transaction(mode)
        connections, close = self.connect(writers)
        try:
            return _threads(connections, transaction, seconds)
        finally:
            close()

    def run(self, mode: str, count: int, first: int) -> None:
        """``count`` transactions of ``mode`` on one connection, one after another, orders
        ``first`` on (what ``bench.stage_cpu`` counts the instructions of)."""
        transaction = self.transaction(mode)
        (conn,), close = self.connect(1)
        try:
            for n in range(first, first + count):
                transaction(conn, n)
        finally:
            close()

    def transaction(self, mode: str) -> Callable[[Any, int], None]:
        """One transaction of ``mode`` on a connection, for order ``n``."""
        raise NotImplementedError

    def connect(self, count: int) -> tuple[list[Any], Callable[[], None]]:
        """``count`` connections, and what closes them."""
        raise NotImplementedError


class PsycopgClient(SyncClient):
    """Threads, one psycopg 3 connection each; ``SyncOutbox.stage(conn, ...)``."""

    def transaction(self, mode: str) -> Callable[[Any, int], None]:
        outbox = SyncOutbox(self.config)
        order_sql, hand_sql = _pg(ORDER), _pg(HAND_NOTIFY if mode == "hand+notify" else HAND)

        def transaction(conn: psycopg.Connection[Any], n: int) -> None:
            event = order(n)
            with conn.transaction():
                conn.execute(order_sql, _business(event, n), prepare=True)
                if mode == "stage":
                    outbox.stage(conn, event, database=self.kind, stream_key=f"order-{n}")
                else:
                    conn.execute(hand_sql, _hand(event, n, mode == "hand+notify"), prepare=True)

        return transaction

    def connect(self, count: int) -> tuple[list[Any], Callable[[], None]]:
        connections = [psycopg.connect(self.url) for _ in range(count)]

        def close() -> None:
            for conn in connections:
                conn.close()

        return connections, close


class MysqlClient(SyncClient):
    """Threads, SQLAlchemy + PyMySQL, a pool of K; ``SyncOutbox.stage(connection, ...)``."""

    def transaction(self, mode: str) -> Callable[[Any, int], None]:
        outbox = SyncOutbox(self.config)

        def transaction(conn: sqlalchemy.Connection, n: int) -> None:
            event = order(n)
            with conn.begin():
                conn.exec_driver_sql(ORDER, _business(event, n))
                if mode == "stage":
                    outbox.stage(conn, event, database=self.kind, stream_key=f"order-{n}")
                else:
                    row = _hand(event, n, notify=False)
                    conn.exec_driver_sql(HAND, (str(row[0]), *row[1:]))

        return transaction

    def connect(self, count: int) -> tuple[list[Any], Callable[[], None]]:
        url = self.url.replace("mysql://", "mysql+pymysql://", 1)
        engine = sqlalchemy.create_engine(url, pool_size=count, max_overflow=0)
        connections = [engine.connect() for _ in range(count)]

        def close() -> None:
            for conn in connections:
                conn.close()
            engine.dispose()

        return connections, close


class AsyncpgClient(Client):
    """Tasks on an asyncpg pool of K connections (uvloop); ``Outbox.stage(conn, ...)`` with
    the raw connection. Each task holds its connection for the whole point: acquiring per
    transaction adds the pool's reset query on release, the same for every mode."""

    def point(self, mode: str, writers: int, seconds: float) -> float:
        return uvloop.run(self._point(mode, writers, seconds))

    def run(self, mode: str, count: int, first: int) -> None:
        """``SyncClient.run`` on one asyncpg connection, on uvloop."""
        uvloop.run(self._run(mode, count, first))

    async def _run(self, mode: str, count: int, first: int) -> None:
        transaction = self.transaction(mode)
        conn = await asyncpg.connect(self.url)
        try:
            for n in range(first, first + count):
                await transaction(conn, n)
        finally:
            await conn.close()

    def transaction(self, mode: str) -> Callable[[asyncpg.Connection, int], Awaitable[None]]:
        """One transaction of ``mode`` on a connection, for order ``n``."""
        outbox = Outbox(self.config)
        order_sql = _numbered(ORDER)
        hand_sql = _numbered(HAND_NOTIFY if mode == "hand+notify" else HAND)

        async def transaction(conn: asyncpg.Connection, n: int) -> None:
            event = order(n)
            async with conn.transaction():
                await conn.execute(order_sql, *_business(event, n))
                if mode == "stage":
                    await outbox.stage(conn, event, database=self.kind, stream_key=f"order-{n}")
                else:
                    await conn.execute(hand_sql, *_hand(event, n, mode == "hand+notify"))

        return transaction

    async def _point(self, mode: str, writers: int, seconds: float) -> float:
        transaction = self.transaction(mode)
        async with asyncpg.create_pool(self.url, min_size=writers, max_size=writers) as pool:
            connections = [await pool.acquire() for _ in range(writers)]
            try:
                return await _tasks(connections, transaction, seconds)
            finally:
                for conn in connections:
                    await pool.release(conn)


def make_client(name: str, url: str, config: Any) -> Client:
    """The client called ``name`` on ``url``; ``config`` names the database by its kind."""
    made: type[Client] = {
        "psycopg": PsycopgClient,
        "asyncpg": AsyncpgClient,
        "mysql": MysqlClient,
    }[name]
    return made(name, url, config)


def _threads(
    connections: list[Any], transaction: Callable[[Any, int], None], seconds: float
) -> float:
    """Each connection in a thread of its own, committing until ``seconds`` are over, after
    one uncounted transaction (the prepared statements, the outbox's caches); commits/s."""
    for conn in connections:
        transaction(conn, next(_ids))
    started: list[float] = []
    barrier = threading.Barrier(len(connections), action=lambda: started.append(time.monotonic()))
    counts, ended = [0] * len(connections), [0.0] * len(connections)

    def writer(i: int) -> None:
        barrier.wait()
        deadline = started[0] + seconds
        while time.monotonic() < deadline:
            transaction(connections[i], next(_ids))
            counts[i] += 1
        ended[i] = time.monotonic()

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(len(connections))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) / (max(ended) - started[0])


async def _tasks(
    connections: list[Any], transaction: Callable[[Any, int], Awaitable[None]], seconds: float
) -> float:
    """``_threads`` as tasks on one event loop."""
    for conn in connections:
        await transaction(conn, next(_ids))
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + seconds

    async def writer(conn: Any) -> tuple[int, float]:
        count = 0
        while loop.time() < deadline:
            await transaction(conn, next(_ids))
            count += 1
        return count, loop.time()

    done = await asyncio.gather(*(writer(conn) for conn in connections))
    return sum(c for c, _ in done) / (max(t for _, t in done) - started)


def create_tables(kind: str, url: str) -> None:
    """The business table and the hand outbox in the database at ``url``."""
    if kind == "postgresql":
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(PG_TABLES)
        return
    engine = sqlalchemy.create_engine(url.replace("mysql://", "mysql+pymysql://", 1))
    try:
        with engine.begin() as conn:
            for statement in MYSQL_TABLES:
                conn.exec_driver_sql(statement)
    finally:
        engine.dispose()
