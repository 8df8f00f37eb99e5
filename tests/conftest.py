"""Fixtures shared by every test: real PostgreSQL and MariaDB databases, NATS streams, SQLite
files, and ``database``: one test on a fresh database of each kind. Also the hook that marks
the fast tier (``pytest -m fast``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Coroutine, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncpg
import nats
import pytest
from nats.js.errors import NotFoundError
from sqlalchemy import text

from router import Outbox, RouterConfig
from router.config import DatabaseSettings
from router.ops.migrate import upgrade
from tests.private_postgres import LOGICAL_DECODING, PrivatePostgres, require_postgres_programs
from tests.services import MARIADB, NATS, NO_SKIPS, POSTGRES, in_ci, require, skips_fail

if TYPE_CHECKING:
    from tests.contract.harnesses import RedisHarness
    from tests.mariadb_binlog import BinlogServer

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
NATS_URL = "nats://127.0.0.1:4222"

# The fast tier, `pytest -m fast` (scripts/fast): tests that need no service running and start
# no peer, for the inner loop. That is tests/unit/ (SQLite files and the in-memory broker). The
# contract suite is not in it: every value of its `harness` (KINDS, tests/contract/conftest.py)
# is a real broker or a peer the tests start; it has no in-memory one.
FAST_FOLDERS = ("tests/unit/",)
# Fixtures that reach a service or start a peer, directly or through the fixtures they use: a
# test under FAST_FOLDERS that needs one (a unit test on PostgreSQL, say) stays out of the tier.
SERVICE_FIXTURES = frozenset(
    {
        "pg_template",  # PostgreSQL (pg_databases, pg_url and database use it)
        "private_postgres",  # a PostgreSQL server of the session's own, started per session
        "mysql_databases",  # MariaDB (mysql_url and database use it)
        "nats_streams",  # NATS JetStream
        "kafka_peer",  # tansu, started per session
        "servicebus_peer",  # the AMQP 1.0 Service Bus peer, started per session
        "redis_harness",  # Redis
        "pg_logical",  # a private PostgreSQL cluster with wal_level=logical, per session
        "mariadb_binlog",  # a private mariadbd with the binlog on, started per session
    }
)


# Tests that run alone, after the rest (scripts/test runs the rest two at a time): their
# figures are timings under load they make themselves (the chaos runs, the partitions), which
# a neighbouring test's load would blur.
SERIAL_PATHS = ("tests/chaos/", "tests/contract/test_partition.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the fast tier (the tests under FAST_FOLDERS that use no SERVICE_FIXTURES) and the
    serial one (SERIAL_PATHS)."""
    for item in items:
        needs = SERVICE_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if item.nodeid.startswith(FAST_FOLDERS) and not needs:
            item.add_marker(pytest.mark.fast)
        if item.nodeid.startswith(SERIAL_PATHS):
            item.add_marker(pytest.mark.serial)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Turn a skip into a failure where none may happen (``skips_fail``): a run by hand
    through scripts/test must not pass with the service tests skipped for want of a server."""
    report = yield
    if not report.skipped or hasattr(report, "wasxfail") or not skips_fail():
        return report
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped, and no test may skip here (CI or {NO_SKIPS}=1): {reason}"
    return report


def database_url(name: str) -> str:
    """URL of a database on the test server."""
    return f"postgresql://postgres@127.0.0.1:5432/{name}"


@pytest.fixture(scope="session")
def pg_template() -> Iterator[str]:
    """A migrated database to copy from: one migration per session, not per test."""
    require("PostgreSQL", POSTGRES)
    name = f"router_tpl_{uuid.uuid4().hex[:8]}"

    async def create() -> None:
        admin = await asyncpg.connect(PG_ADMIN)
        try:
            await admin.execute(f'CREATE DATABASE "{name}"')
        finally:
            await admin.close()
        await upgrade(
            name, DatabaseSettings.model_validate({"url": database_url(name)}), Path.cwd()
        )

    asyncio.run(create())
    yield name
    asyncio.run(_drop_database(name))


@pytest.fixture(scope="session")
def private_postgres() -> Iterator[PrivatePostgres]:
    """A PostgreSQL server of the session's own, for tests that crash or restart one: the
    shared server on 5432 carries every other test and session on the machine. Started when
    the first test asks for it (about a second), removed at the end, whatever happened."""
    server = PrivatePostgres(require_postgres_programs())
    try:
        _run_aside(_start(server))
        yield server
    finally:
        _run_aside(server.close())


async def _start(server: PrivatePostgres, settings: str = "") -> None:
    await server.create(settings=settings)
    await server.start()


def _run_aside(work: Coroutine[Any, Any, None]) -> None:
    """Run ``work`` to the end in a thread of its own: a test may ask for a session fixture
    (``request.getfixturevalue``) from inside its event loop, where asyncio.run cannot."""
    with ThreadPoolExecutor(1) as thread:
        thread.submit(asyncio.run, work).result()


@pytest.fixture(scope="session")
def pg_logical() -> Iterator[PrivatePostgres]:
    """A private PostgreSQL server with ``wal_level = logical``, for the log wake-up's tests
    (the shared server runs ``replica`` and is never reconfigured). Started when a test first
    asks for it, removed at the end of the session."""
    server = PrivatePostgres(require_postgres_programs(), name="logical")
    try:
        _run_aside(_start(server, LOGICAL_DECODING))
        yield server
    finally:
        _run_aside(server.close())


@dataclass
class PgDatabases:
    """Creates migrated PostgreSQL databases for one test and drops them afterwards."""

    template: str
    created: list[str]

    async def new(self, *, migrated: bool = True) -> str:
        """A fresh database; returns its URL."""
        name = f"router_t_{uuid.uuid4().hex[:10]}"
        admin = await asyncpg.connect(PG_ADMIN)
        try:
            template = f' TEMPLATE "{self.template}"' if migrated else ""
            await admin.execute(f'CREATE DATABASE "{name}"{template}')
        finally:
            await admin.close()
        self.created.append(name)
        return database_url(name)


@pytest.fixture
async def pg_databases(pg_template: str) -> AsyncIterator[PgDatabases]:
    """Make as many fresh, migrated databases as a test needs."""
    databases = PgDatabases(pg_template, [])
    yield databases
    for name in databases.created:
        await _drop_database(name)


@pytest.fixture
async def pg_url(pg_databases: PgDatabases) -> str:
    """One fresh, migrated PostgreSQL database."""
    return await pg_databases.new()


async def pg_fetch(url: str, query: str, *args: Any) -> list[asyncpg.Record]:
    """Run one query on a fresh connection to ``url`` and return its rows."""
    conn = await asyncpg.connect(url)
    try:
        return list(await conn.fetch(query, *args))
    finally:
        await conn.close()


# A PostgreSQL batch writes nothing on its rows while it publishes them (migration 0010): what
# shows it is the per-target advisory lock its transaction holds, keyed as router_claim() does,
# and its session's application_name, the worker's id for as long as the batch lasts.
_BATCH_HOLDER = """
SELECT a.application_name FROM pg_locks l
JOIN pg_database d ON d.oid = l.database JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND d.datname = current_database()
  AND l.classid = $1::bigint::oid AND l.objid = (hashtext($2)::bigint & 4294967295)::oid
"""


async def batch_holder(url: str, target: str) -> str | None:
    """The id of the worker whose batch of ``target`` is being published now (PostgreSQL)."""
    from router.relay.store.postgres_sql import CLAIM_LOCK_NAMESPACE

    rows = await pg_fetch(url, _BATCH_HOLDER, CLAIM_LOCK_NAMESPACE, target)
    return str(rows[0][0]) if rows else None


async def batch_in_flight(url: str, target: str) -> bool:
    """Whether a router's batch of ``target`` is being published now (PostgreSQL)."""
    return await batch_holder(url, target) is not None


async def _drop_database(name: str) -> None:
    admin = await asyncpg.connect(PG_ADMIN)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


MYSQL_ADMIN = {"host": MARIADB[0], "port": MARIADB[1], "user": "root", "password": ""}


def mysql_database_url(name: str) -> str:
    """URL of a database on the MariaDB test server."""
    return f"mysql://root@{MARIADB[0]}:{MARIADB[1]}/{name}"


@dataclass
class MysqlDatabases:
    """Creates MariaDB databases for one test and drops them afterwards.

    MariaDB has no template databases: each is migrated with ``router init-db``'s own
    ``upgrade`` (a tenth of a second). The server is required when a test asks for a database,
    so a test parametrised over every kind needs MariaDB only for its MariaDB case.
    """

    created: list[str]

    async def new(self, *, migrated: bool = True) -> str:
        """A fresh database, migrated unless told otherwise; returns its URL."""
        require("MariaDB", MARIADB)
        name = f"router_t_{uuid.uuid4().hex[:10]}"
        await mysql_fetch(None, f"CREATE DATABASE `{name}`")
        self.created.append(name)
        url = mysql_database_url(name)
        if migrated:
            await upgrade(name, DatabaseSettings.model_validate({"url": url}), Path.cwd())
        return url


@pytest.fixture
async def mysql_databases() -> AsyncIterator[MysqlDatabases]:
    """Make as many fresh MariaDB databases as a test needs."""
    databases = MysqlDatabases([])
    yield databases
    for name in databases.created:
        await mysql_fetch(None, f"DROP DATABASE IF EXISTS `{name}`")


@pytest.fixture
async def mysql_url(mysql_databases: MysqlDatabases) -> str:
    """One fresh, migrated MariaDB database."""
    return await mysql_databases.new()


async def mysql_fetch(url: str | None, query: str, *args: Any) -> list[dict[str, Any]]:
    """Run one statement on a fresh connection to ``url`` (None: the server, no database)
    and return its rows as dicts."""
    import asyncmy
    from asyncmy.cursors import DictCursor

    database = url.rpartition("/")[2] if url else None
    conn = await asyncmy.connect(**MYSQL_ADMIN, database=database, autocommit=True)
    try:
        async with conn.cursor(DictCursor) as cursor:
            await cursor.execute(query, args or None)
            return list(await cursor.fetchall())
    finally:
        await conn.ensure_closed()


MEMORY_BROKERS: dict[str, Any] = {
    "events": {"type": "memory", "internal": True},
    "analytics": {"type": "memory"},
    "billing": {"type": "memory", "envelope": "cloudevents"},
}


@dataclass(frozen=True)
class Database:
    """A fresh, migrated outbox database of one kind, for tests that run on every kind."""

    kind: str
    url: str
    base_dir: Path

    def outbox(self, brokers: dict[str, Any] | None = None) -> Outbox:
        """An outbox on this database, with memory brokers unless told otherwise."""
        config = make_config({"main": self.url}, brokers or MEMORY_BROKERS, base_dir=self.base_dir)
        return Outbox(config)

    async def execute(self, *statements: Any) -> list[dict[str, Any]]:
        """Run statements (SQLAlchemy Core, or SQL text) in one transaction of their own;
        returns the last one's rows."""
        outbox = self.outbox()
        found: list[dict[str, Any]] = []
        try:
            async with outbox.engine().begin() as conn:
                for statement in statements:
                    result = await conn.execute(
                        text(statement) if isinstance(statement, str) else statement
                    )
                    found = [row._asdict() for row in result] if result.returns_rows else []
        finally:
            await outbox.close()
        return found

    async def fetch(self, query: str) -> list[dict[str, Any]]:
        """The rows of one query, on a connection of its own."""
        return await self.execute(query)

    async def rows(self) -> list[dict[str, Any]]:
        """Every row, in seq order, with its envelope parsed."""
        # MySQL's envelope is text already, and it has no CAST(... AS TEXT).
        envelope = "envelope" if self.kind == "mysql" else "CAST(envelope AS TEXT) AS envelope"
        found = await self.fetch(
            f"SELECT seq, message_id, target, destination, event_type, stream_key, {envelope}, "
            "status, attempts FROM router_outbox ORDER BY seq"
        )
        return [
            {**row, "message_id": str(row["message_id"]), "envelope": json.loads(row["envelope"])}
            for row in found
        ]


async def make_database(
    kind: str, pg_databases: PgDatabases, mysql_databases: MysqlDatabases, tmp_path: Path
) -> Database:
    """A fresh, migrated database of ``kind``."""
    if kind == "postgresql":
        return Database(kind, await pg_databases.new(), tmp_path)
    if kind == "mysql":
        return Database(kind, await mysql_databases.new(), tmp_path)
    url = "sqlite:///outbox.db"
    await upgrade("main", DatabaseSettings.model_validate({"url": url}), tmp_path)
    return Database(kind, url, tmp_path)


@pytest.fixture(params=["postgresql", "sqlite", "mysql"])
async def database(
    request: pytest.FixtureRequest,
    pg_databases: PgDatabases,
    mysql_databases: MysqlDatabases,
    tmp_path: Path,
) -> Database:
    """The same test on a fresh PostgreSQL database, SQLite file and MariaDB database (a test
    may pick the kinds with ``parametrize(..., indirect=["database"])``)."""
    return await make_database(request.param, pg_databases, mysql_databases, tmp_path)


CALLER_TABLE = "CREATE TABLE caller_orders (id VARCHAR(40))"


@dataclass(frozen=True)
class Grantee:
    """A role (PostgreSQL) or user (MariaDB) of its own on a fresh, migrated database, with
    rights on the caller's table (``caller_orders``) and none on the router's."""

    database: Database
    """The database as the grantee logs in to it."""
    owner: Database
    """The same database as its owner, for the GRANT."""
    account: str
    """The grantee as GRANT names it."""


@dataclass
class Grantees:
    """Makes grantees for one test, and drops them (and their grants) afterwards."""

    pg_databases: PgDatabases
    mysql_databases: MysqlDatabases
    base_dir: Path
    made: list[Grantee]

    async def new(self, kind: str) -> Grantee:
        """A grantee on a fresh database of ``kind``."""
        name = f"router_r_{uuid.uuid4().hex[:10]}"
        owner = await make_database(kind, self.pg_databases, self.mysql_databases, self.base_dir)
        host, _, database = owner.url.partition("@")[2].partition("/")
        scheme = owner.url.partition("://")[0]
        account = name if kind == "postgresql" else f"'{name}'@'%'"
        create = f"CREATE ROLE {name} LOGIN" if kind == "postgresql" else f"CREATE USER {account}"
        await owner.execute(create)
        made = Grantee(
            Database(kind, f"{scheme}://{name}@{host}/{database}", self.base_dir), owner, account
        )
        self.made.append(made)
        await owner.execute(CALLER_TABLE, f"GRANT SELECT, INSERT ON caller_orders TO {account}")
        return made

    async def drop(self) -> None:
        """Drop every grantee made (before its database goes)."""
        for grantee in self.made:
            if grantee.database.kind == "postgresql":
                await grantee.owner.execute(
                    f"DROP OWNED BY {grantee.account}", f"DROP ROLE {grantee.account}"
                )
            else:
                await grantee.owner.execute(f"DROP USER {grantee.account}")


@pytest.fixture
async def grantees(
    pg_databases: PgDatabases, mysql_databases: MysqlDatabases, tmp_path: Path
) -> AsyncIterator[Grantees]:
    """Make as many grantees without rights on the router's tables as a test needs."""
    made = Grantees(pg_databases, mysql_databases, tmp_path, [])
    yield made
    await made.drop()


@dataclass
class NatsStreams:
    """Unique stream names and subject prefixes per test, deleted afterwards."""

    prefix: str
    created: list[str]

    def stream(self, label: str) -> tuple[str, str]:
        """A (stream name, subject prefix) pair no other test uses."""
        name = f"T{self.prefix}_{label}".upper()
        self.created.append(name)
        return name, f"t{self.prefix}.{label}"

    async def messages(self, stream: str, expected: int, timeout: float = 10.0) -> list[Any]:
        """Wait until ``stream`` holds ``expected`` messages; return all it holds, in order."""
        client = await nats.connect(NATS_URL)
        try:
            js = client.jetstream()
            deadline = asyncio.get_running_loop().time() + timeout
            count = 0
            while True:
                try:
                    count = (await js.stream_info(stream)).state.messages
                except NotFoundError:
                    count = 0
                if count >= expected or asyncio.get_running_loop().time() > deadline:
                    break
                await asyncio.sleep(0.05)
            return [await js.get_msg(stream, seq=i) for i in range(1, count + 1)] if count else []
        finally:
            await client.close()


@pytest.fixture
async def nats_streams() -> AsyncIterator[NatsStreams]:
    """Per-test JetStream streams on the NATS server at 127.0.0.1:4222."""
    require("NATS", NATS)
    streams = NatsStreams(uuid.uuid4().hex[:8], [])
    yield streams
    client = await nats.connect(NATS_URL)
    try:
        js = client.jetstream()
        for name in streams.created:
            with contextlib.suppress(NotFoundError):
                await js.delete_stream(name)
    finally:
        await client.close()


def nats_broker(stream: tuple[str, str], **extra: Any) -> dict[str, Any]:
    """A NATS broker config for a test stream."""
    name, subject = stream
    return {
        "type": "nats",
        "url": NATS_URL,
        "destination": subject + ".{event_type}",
        "stream": {"name": name, "subjects": [subject + ".>"], "storage": "memory"},
        **extra,
    }


def make_config(
    databases: dict[str, Any],
    brokers: dict[str, Any],
    base_dir: Path | None = None,
    **sections: Any,
) -> RouterConfig:
    """A validated config from plain dicts, as config.yaml would give it."""
    data: dict[str, Any] = {
        "service": "shop",
        "databases": databases,
        "brokers": brokers,
        "http": {"enabled": False},
        **sections,
    }
    config = RouterConfig.model_validate(data)
    return config.with_base_dir(base_dir or Path.cwd())


@pytest.fixture
async def log_url(pg_logical: PrivatePostgres) -> AsyncIterator[str]:
    """A fresh database on the private server with wal_level=logical, migrated (so it has
    the publication ``router_wakeup``)."""
    name = f"router_log_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(pg_logical.url())
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    url = pg_logical.url(name)
    await upgrade("main", DatabaseSettings.model_validate({"url": url}), Path.cwd())
    yield url
    admin = await asyncpg.connect(pg_logical.url())
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest.fixture(scope="session")
def mariadb_binlog() -> Iterator[BinlogServer]:
    """A private MariaDB with the binlog on (ROW), on a free port, for the whole session: the
    shared server's binlog is off. Fails under CI when it cannot start; skips elsewhere."""
    from tests.mariadb_binlog import BinlogServer

    server = BinlogServer()
    try:
        server.start()
    except Exception as exc:
        server.stop()
        message = f"a private mariadbd with the binlog on did not start: {exc}"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)
    yield server
    server.stop()


@pytest.fixture
async def binlog_url(mariadb_binlog: BinlogServer) -> AsyncIterator[str]:
    """One fresh, migrated database on the private MariaDB whose binlog is on."""
    name = f"router_t_{uuid.uuid4().hex[:10]}"
    await asyncio.to_thread(mariadb_binlog.execute, f"CREATE DATABASE `{name}`")
    url = mariadb_binlog.url(name)
    await upgrade(name, DatabaseSettings.model_validate({"url": url}), Path.cwd())
    yield url
    await asyncio.to_thread(mariadb_binlog.execute, f"DROP DATABASE IF EXISTS `{name}`")


@pytest.fixture(scope="session")
def kafka_peer() -> Iterator[str]:
    """tansu (Kafka-compatible, in memory) on a free port, for the whole session."""
    from tests.peers.kafka import TansuPeer
    from tests.services import free_port

    peer = TansuPeer(free_port())
    peer.start()
    yield peer.bootstrap
    peer.stop()


@pytest.fixture(scope="session")
def servicebus_peer() -> Iterator[Any]:
    """The AMQP 1.0 Service Bus peer on a free port, for the whole session."""
    from tests.peers.servicebus import ServiceBusPeer
    from tests.services import free_port

    peer = ServiceBusPeer(port=free_port())
    peer.start()
    yield peer
    peer.stop()


@pytest.fixture
async def redis_harness() -> AsyncIterator[RedisHarness]:
    """The contract suite's Redis harness on the shared Redis; its streams removed after."""
    from tests.contract.harnesses import RedisHarness
    from tests.services import REDIS

    require("Redis", REDIS)
    harness = RedisHarness()
    yield harness
    await harness.cleanup()
