"""``SyncOutbox.stage`` on every sync connection an application has, against the real
databases: SQLAlchemy sessions and connections on psycopg 3, psycopg2, PyMySQL (MariaDB)
and pysqlite, and raw psycopg 3, psycopg2 and sqlite3 connections.

Each: the rows are the caller's transaction's (committed with it, gone with its rollback),
per-stream commit order holds between concurrent writer threads, a refused event leaves the
transaction usable and says what the async path says, and autocommit is refused.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

import psycopg
import psycopg2
import psycopg2.extensions
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from router import Event, Outbox, StagingError, SyncOutbox
from router._wakeup import WAKE_LOCK_NAMESPACE
from router.write.mysql import MYSQL_MAX_STREAM_KEY
from tests.conftest import (
    MEMORY_BROKERS,
    Database,
    Grantees,
    MysqlDatabases,
    PgDatabases,
    make_config,
)
from tests.conftest import make_database as make_database
from tests.integration.events import (
    NATS_BROKERS,
    NO_TABLES,
    PG_ABORTED,
    REFUSED_INPUT,
    OrderPlaced,
    StockReserved,
    grants_named,
    not_granted,
)

Transaction = Callable[[], AbstractContextManager[Any]]
"""Opens the caller's transaction; yields what to stage on; commits, or rolls back on error."""


@dataclass
class Client:
    """One way a sync application holds a connection, on one fresh database."""

    database: Database
    transaction: Transaction
    autocommit: Transaction  # a connection that commits each statement on its own
    close: Callable[[], None]

    def outbox(self, brokers: dict[str, Any] | None = None) -> SyncOutbox:
        """A sync outbox on this database (memory brokers unless told otherwise)."""
        config = make_config(
            {"main": self.database.url}, brokers or MEMORY_BROKERS, base_dir=self.database.base_dir
        )
        return SyncOutbox(config)


def sa_url(database: Database, driver: str) -> str:
    if database.kind == "sqlite":
        return f"sqlite+pysqlite:///{database.base_dir / 'outbox.db'}"
    return database.url.replace("://", f"+{driver}://", 1)


def sqlalchemy_client(database: Database, driver: str, *, session: bool) -> Client:
    engine = sa.create_engine(sa_url(database, driver))
    autocommit_engine = engine.execution_options(isolation_level="AUTOCOMMIT")

    @contextmanager
    def transaction(bind: sa.Engine = engine) -> Iterator[Any]:
        if session:
            with Session(bind) as s, s.begin():
                yield s
        else:
            with bind.begin() as conn:
                yield conn

    return Client(database, transaction, lambda: transaction(autocommit_engine), engine.dispose)


def psycopg_client(database: Database, *, prepare: bool = True) -> Client:
    """``prepare=False``: preparing off (``prepare_threshold=None``), as Django's
    connection has it by default, so stage() sends its simple form."""
    options: dict[str, Any] = {} if prepare else {"prepare_threshold": None}

    @contextmanager
    def transaction() -> Iterator[Any]:
        with psycopg.connect(database.url, **options) as conn:  # commits, or rolls back
            yield conn

    @contextmanager
    def autocommit() -> Iterator[Any]:
        with psycopg.connect(database.url, autocommit=True, **options) as conn:
            yield conn

    return Client(database, transaction, autocommit, lambda: None)


def psycopg2_client(database: Database) -> Client:
    @contextmanager
    def transaction(autocommit: bool = False) -> Iterator[Any]:
        conn = psycopg2.connect(database.url)
        conn.autocommit = autocommit
        try:
            with conn:  # commits, or rolls back on error
                yield conn
        finally:
            conn.close()

    return Client(database, transaction, lambda: transaction(True), lambda: None)


def sqlite3_client(database: Database) -> Client:
    path = database.base_dir / "outbox.db"

    @contextmanager
    def transaction(isolation_level: Literal["DEFERRED"] | None = "DEFERRED") -> Iterator[Any]:
        conn = sqlite3.connect(path, timeout=10, isolation_level=isolation_level)
        try:
            with conn:  # commits, or rolls back on error
                yield conn
        finally:
            conn.close()

    return Client(database, transaction, lambda: transaction(None), lambda: None)


CLIENTS: dict[str, tuple[str, Callable[[Database], Client]]] = {
    "session-psycopg": ("postgresql", lambda d: sqlalchemy_client(d, "psycopg", session=True)),
    "session-psycopg2": ("postgresql", lambda d: sqlalchemy_client(d, "psycopg2", session=True)),
    "connection-psycopg": (
        "postgresql",
        lambda d: sqlalchemy_client(d, "psycopg", session=False),
    ),
    "session-pymysql": ("mysql", lambda d: sqlalchemy_client(d, "pymysql", session=True)),
    "connection-pymysql": ("mysql", lambda d: sqlalchemy_client(d, "pymysql", session=False)),
    "session-pysqlite": ("sqlite", lambda d: sqlalchemy_client(d, "pysqlite", session=True)),
    "psycopg": ("postgresql", psycopg_client),
    "psycopg-unprepared": ("postgresql", lambda d: psycopg_client(d, prepare=False)),
    "psycopg2": ("postgresql", psycopg2_client),
    "sqlite3": ("sqlite", sqlite3_client),
}


@pytest.fixture(params=list(CLIENTS))
async def client(
    request: pytest.FixtureRequest,
    pg_databases: PgDatabases,
    mysql_databases: MysqlDatabases,
    tmp_path: Path,
) -> Any:
    kind, make = CLIENTS[request.param]
    made = make(await make_database(kind, pg_databases, mysql_databases, tmp_path))
    yield made
    made.close()


async def test_rows_commit_with_the_callers_transaction(client: Client) -> None:
    outbox = client.outbox()
    with client.transaction() as conn:
        ids = outbox.stage(
            conn,
            OrderPlaced(order_id="o-1", total=Decimal("9.50")),
            StockReserved(order_id="o-1", quantity=2),
            stream_key="o-1",
            correlation_id="req-1",
        )
    stored = await client.database.rows()
    assert [r["target"] for r in stored] == ["events", "analytics", "billing", "events"]
    assert [r["message_id"] for r in stored] == [ids[0]] * 3 + [ids[1]]
    assert {r["stream_key"] for r in stored} == {"o-1"}
    assert stored[0]["envelope"]["payload"] == {"order_id": "o-1", "total": "9.50", "note": None}
    assert stored[0]["envelope"]["correlation_id"] == "req-1"


async def test_a_rolled_back_transaction_stages_nothing(client: Client) -> None:
    outbox = client.outbox()
    with pytest.raises(RuntimeError, match="business rule"), client.transaction() as conn:
        outbox.stage(conn, OrderPlaced(order_id="o-1", total=Decimal(1)))
        raise RuntimeError("business rule")
    assert await client.database.rows() == []


async def test_a_refused_event_leaves_the_transaction_usable_and_says_what_async_says(
    client: Client,
) -> None:
    outbox = client.outbox()
    too_large = OrderPlaced(order_id="x" * 400_000, total=Decimal(1))
    with client.transaction() as conn:
        with pytest.raises(StagingError) as refused:
            outbox.stage(conn, StockReserved(order_id="ok", quantity=1), too_large)
        outbox.stage(conn, StockReserved(order_id="after", quantity=1))
    stored = await client.database.rows()
    assert [r["envelope"]["payload"]["order_id"] for r in stored] == ["after"]

    async_outbox = Outbox(outbox.config)
    try:
        async with async_outbox.transaction() as tx:
            with pytest.raises(StagingError) as refused_async:
                await tx.stage(StockReserved(order_id="ok", quantity=1), too_large)
    finally:
        await async_outbox.close()
    assert str(refused.value) == str(refused_async.value)
    assert "the limit (outbox.max_payload_bytes)" in str(refused.value)


@pytest.mark.parametrize(
    "bad",
    [
        lambda outbox, conn: outbox.stage(conn, {"order_id": "o"}),
        lambda outbox, conn: outbox.stage(
            conn, StockReserved(order_id="o", quantity=1), stream_keys=["a", "b"]
        ),
        lambda outbox, conn: outbox.stage(
            conn, StockReserved(order_id="o", quantity=1), headers={"n": 1}
        ),
        lambda outbox, conn: outbox.stage(
            conn, StockReserved(order_id="o", quantity=1), database="other"
        ),
    ],
    ids=["not-an-event", "keys-length", "header-type", "unknown-database"],
)
async def test_bad_input_gets_the_async_paths_message(client: Client, bad: Any) -> None:
    outbox = client.outbox()
    with client.transaction() as conn, pytest.raises(StagingError) as refused:
        bad(outbox, conn)

    async_outbox = Outbox(outbox.config)
    try:
        async with async_outbox.transaction() as tx:
            calls: list[Any] = []
            bad(_Capture(calls), tx.connection)
            args, kwargs = calls[0]
            with pytest.raises(StagingError) as refused_async:
                await async_outbox.stage(*args, **kwargs)
    finally:
        await async_outbox.close()
    assert str(refused.value) == str(refused_async.value)
    assert await client.database.rows() == []


class _Capture:
    """Stands in for an outbox to record the arguments of one ``stage`` call."""

    def __init__(self, calls: list[Any]) -> None:
        self.calls = calls

    def stage(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append((args, kwargs))


async def test_a_published_event_no_broker_takes_is_refused(client: Client) -> None:
    outbox = client.outbox({"partner": {"type": "memory", "events": {"include": ["billing.*"]}}})
    with client.transaction() as conn, pytest.raises(StagingError, match="has no target"):
        outbox.stage(conn, OrderPlaced(order_id="o", total=Decimal(1)))
    assert await client.database.rows() == []


async def test_autocommit_is_refused_and_writes_nothing(client: Client) -> None:
    outbox = client.outbox()
    with client.autocommit() as conn, pytest.raises(StagingError) as refused:
        outbox.stage(conn, StockReserved(order_id="o", quantity=1))
    assert str(refused.value).startswith("stage() needs the connection inside a transaction, but")
    assert "so each statement would commit on its own, apart from the caller's work" in str(
        refused.value
    )
    assert await client.database.rows() == []


async def test_a_second_writer_on_the_same_stream_waits_for_the_first_to_commit(
    client: Client,
) -> None:
    # Per-stream commit order: the second transaction staging on a key cannot get its rows a
    # seq until the first commits, so seq order is commit order (SQLite: one writer at all).
    outbox = client.outbox()
    staged, release, second_done = threading.Event(), threading.Event(), threading.Event()
    order: list[str] = []

    def first() -> None:
        with client.transaction() as conn:
            outbox.stage(conn, StockReserved(order_id="first", quantity=1), stream_key="k")
            staged.set()
            release.wait(10)
            order.append("first commits")

    def second() -> None:
        staged.wait(10)
        with client.transaction() as conn:
            outbox.stage(conn, StockReserved(order_id="second", quantity=1), stream_key="k")
        order.append("second committed")
        second_done.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    assert staged.wait(10)
    assert not second_done.wait(0.5), "the second writer did not wait for the first"
    release.set()
    for thread in threads:
        thread.join(15)
    assert order == ["first commits", "second committed"]
    stored = await client.database.rows()
    assert [r["envelope"]["payload"]["order_id"] for r in stored] == ["first", "second"]


# Enough events for the bulk form (COPY on psycopg 3), over many streams and none, with the
# characters a text COPY must escape in their payloads.
BATCH_KEYS = [f"s-{n % 40}" if n % 7 else None for n in range(100)]
TRICKY = 'tab\there, new\nline, back\\slash, "quoted", \\N'


async def test_a_large_batch_goes_in_whole_in_order_and_holds_its_streams(
    client: Client,
) -> None:
    outbox = client.outbox()
    events = [StockReserved(order_id=f"{n} {TRICKY}", quantity=n) for n in range(100)]
    staged, release, second_done = threading.Event(), threading.Event(), threading.Event()
    ids: list[str] = []

    def first() -> None:
        with client.transaction() as conn:
            ids.extend(outbox.stage(conn, *events, stream_keys=BATCH_KEYS))
            staged.set()
            release.wait(10)

    def second() -> None:  # on one of the batch's streams: waits for the batch's commit
        staged.wait(10)
        with client.transaction() as conn:
            outbox.stage(conn, StockReserved(order_id="after", quantity=0), stream_key="s-39")
        second_done.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    assert staged.wait(10)
    assert not second_done.wait(0.5), "the second writer did not wait for the batch"
    release.set()
    for thread in threads:
        thread.join(15)
    stored = await client.database.rows()
    assert [r["envelope"]["payload"]["order_id"] for r in stored] == [
        *(e.order_id for e in events),
        "after",
    ]
    assert [r["message_id"] for r in stored[:100]] == ids
    assert [r["stream_key"] for r in stored] == [*BATCH_KEYS, "s-39"]
    assert {(r["target"], r["status"]) for r in stored} == {("events", "pending")}


def idle_relay(listener: psycopg.Connection[Any]) -> None:
    """Make ``listener`` what an idle relay of ``events`` is: listening, holding its wake
    lock (without it, a stager queues no NOTIFY)."""
    listener.execute("LISTEN router_outbox")
    listener.execute("SELECT pg_advisory_lock(%s, hashtext('events'))", (WAKE_LOCK_NAMESPACE,))


async def test_a_large_batch_notifies_at_commit(pg_databases: PgDatabases, tmp_path: Path) -> None:
    database = Database("postgresql", await pg_databases.new(), tmp_path)
    outbox = psycopg_client(database).outbox()
    events = [StockReserved(order_id=str(n), quantity=n) for n in range(100)]
    with psycopg.connect(database.url, autocommit=True) as listener:
        idle_relay(listener)
        with psycopg.connect(database.url) as conn:
            outbox.stage(conn, *events, stream_keys=BATCH_KEYS)
            assert list(listener.notifies(timeout=0.3)) == []  # not before COMMIT
        heard = [n.payload for n in listener.notifies(timeout=5, stop_after=1)]
    assert heard == ["events"]


@pytest.mark.parametrize("driver", ["psycopg", "psycopg-unprepared", "psycopg2"])
async def test_one_event_notifies_its_targets_at_commit(
    driver: str, pg_databases: PgDatabases, tmp_path: Path
) -> None:
    # One event goes in one statement (prepared), or a lock-and-NOTIFY query then the INSERT
    # (where nothing is prepared): either way the wake-up of an idle relay comes with the
    # COMMIT, not before.
    database = Database("postgresql", await pg_databases.new(), tmp_path)
    client = CLIENTS[driver][1](database)
    outbox = client.outbox()
    with psycopg.connect(database.url, autocommit=True) as listener:
        idle_relay(listener)
        with client.transaction() as conn:
            outbox.stage(conn, StockReserved(order_id="1", quantity=1), stream_key="k")
            assert list(listener.notifies(timeout=0.3)) == []  # not before COMMIT
        heard = [n.payload for n in listener.notifies(timeout=5, stop_after=1)]
    assert heard == ["events"]
    stored = await database.rows()
    assert [(r["stream_key"], r["envelope"]["payload"]["order_id"]) for r in stored] == [("k", "1")]


@pytest.mark.parametrize("count", [1, 100])
@pytest.mark.parametrize("prepare", [True, False], ids=["prepared", "unprepared"])
async def test_a_psycopg_connection_in_pipeline_mode_stages_in_order(
    count: int, prepare: bool, pg_databases: PgDatabases, tmp_path: Path
) -> None:
    # Pipeline mode takes neither COPY (100 events) nor two statements in one query (one
    # event where nothing is prepared): stage() sends its prepared forms there.
    database = Database("postgresql", await pg_databases.new(), tmp_path)
    client = psycopg_client(database, prepare=prepare)
    outbox = client.outbox()
    events = [StockReserved(order_id=str(n), quantity=n) for n in range(count)]
    with client.transaction() as conn, conn.pipeline():
        ids = outbox.stage(conn, *events, stream_keys=BATCH_KEYS[:count])
        conn.execute("SELECT 1")  # the caller's own work goes on in the pipeline
    stored = await database.rows()
    assert [r["envelope"]["payload"]["order_id"] for r in stored] == [e.order_id for e in events]
    assert [r["message_id"] for r in stored] == ids
    assert [r["stream_key"] for r in stored] == BATCH_KEYS[:count]


class Numbered(Event, type="numbered"):
    """A writer thread's n-th event."""

    writer: int
    n: int


async def test_concurrent_writer_threads_lose_nothing_and_deadlock_nowhere(client: Client) -> None:
    outbox = client.outbox()
    writers, per_writer, keys = 6, 20, ["a", "b", "c"]
    errors: list[BaseException] = []

    def write(writer: int) -> None:
        try:
            for n in range(per_writer):
                with client.transaction() as conn:
                    outbox.stage(conn, Numbered(writer=writer, n=n), stream_key=keys[n % 3])
        except BaseException as exc:  # reported below, with the thread's error
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert time.monotonic() - started < 60
    stored = await client.database.rows()
    assert len(stored) == writers * per_writer
    for key in keys:
        for writer in range(writers):
            ns = [
                r["envelope"]["payload"]["n"]
                for r in stored
                if r["stream_key"] == key and r["envelope"]["payload"]["writer"] == writer
            ]
            assert ns == sorted(ns) and len(ns) == len(range(keys.index(key), per_writer, 3))


async def test_a_stream_key_longer_than_mysql_keeps_is_refused(
    mysql_databases: MysqlDatabases, pg_databases: PgDatabases, tmp_path: Path
) -> None:
    client = sqlalchemy_client(
        await make_database("mysql", pg_databases, mysql_databases, tmp_path),
        "pymysql",
        session=True,
    )
    outbox = client.outbox()
    try:
        with client.transaction() as conn:
            with pytest.raises(StagingError, match=f"at most {MYSQL_MAX_STREAM_KEY}"):
                outbox.stage(
                    conn,
                    StockReserved(order_id="long", quantity=1),
                    stream_key="k" * (MYSQL_MAX_STREAM_KEY + 1),
                )
            outbox.stage(conn, StockReserved(order_id="ok", quantity=1), stream_key="k")
    finally:
        client.close()
    assert [r["stream_key"] for r in await client.database.rows()] == ["k"]


async def test_async_and_sync_connections_are_sent_to_their_own_outbox(
    pg_databases: PgDatabases, mysql_databases: MysqlDatabases, tmp_path: Path
) -> None:
    database = await make_database("postgresql", pg_databases, mysql_databases, tmp_path)
    sync = sqlalchemy_client(database, "psycopg", session=True)
    outbox = database.outbox()
    try:
        with sync.transaction() as session, pytest.raises(StagingError, match="SyncOutbox"):
            await outbox.stage(session, StockReserved(order_id="o", quantity=1))
        async with outbox.transaction() as tx, tx.connection.begin_nested():
            with pytest.raises(StagingError, match=r"await Outbox\.stage"):
                sync.outbox().stage(tx.connection, StockReserved(order_id="o", quantity=1))
    finally:
        sync.close()
        await outbox.close()
    assert await database.rows() == []


async def test_a_scoped_session_stages_and_tracks_flushes(
    pg_databases: PgDatabases, mysql_databases: MysqlDatabases, tmp_path: Path
) -> None:
    # Flask-SQLAlchemy's db.session is a scoped_session: stage() takes it as the session it
    # stands for, and stage_on_flush() listens on its factory.
    from sqlalchemy.orm import scoped_session, sessionmaker

    from tests.integration.test_entity_events import Base, Order

    database = await make_database("sqlite", pg_databases, mysql_databases, tmp_path)
    engine = sa.create_engine(sa_url(database, "pysqlite"))
    Base.metadata.create_all(engine)
    db_session = scoped_session(sessionmaker(engine))
    outbox = Client(database, lambda: db_session.begin(), db_session.begin, engine.dispose).outbox()
    outbox.stage_on_flush(db_session)
    try:
        with db_session.begin():
            outbox.stage(db_session, StockReserved(order_id="direct", quantity=1))
            order = Order(id="o-9", total=1)
            order.raise_event(StockReserved(order_id="raised", quantity=1))
            db_session.add(order)
    finally:
        db_session.remove()
        engine.dispose()
    stored = await database.rows()
    assert [(r["envelope"]["payload"]["order_id"], r["stream_key"]) for r in stored] == [
        ("direct", None),
        ("raised", "o-9"),
    ]


def execute(conn: Any, sql: str) -> None:
    """Run the caller's own statement on any connection a sync client stages on."""
    if isinstance(conn, Session | sa.Connection):
        conn.execute(sa.text(sql))
    elif isinstance(conn, psycopg2.extensions.connection):
        with conn.cursor() as cursor:
            cursor.execute(sql)
    else:  # psycopg 3 and sqlite3 connections execute on their own
        conn.execute(sql)


CALLER_TABLE = "CREATE TABLE caller_orders (id VARCHAR(40))"
CALLER_INSERT = "INSERT INTO caller_orders (id) VALUES ('o-1')"


async def test_refused_input_leaves_the_callers_transaction_to_commit_its_own_rows(
    client: Client,
) -> None:
    await client.database.execute(CALLER_TABLE)
    outbox = client.outbox(NATS_BROKERS)
    messages = []
    with client.transaction() as conn:
        for events, options, _ in REFUSED_INPUT:
            with pytest.raises(StagingError) as refused:
                outbox.stage(conn, *events, **options)
            messages.append(str(refused.value))
        execute(conn, CALLER_INSERT)
        outbox.stage(conn, StockReserved(order_id="after", quantity=1), stream_key="o-1")
    assert messages == [message for _, _, message in REFUSED_INPUT]
    assert await client.database.fetch("SELECT id FROM caller_orders") == [{"id": "o-1"}]
    stored = await client.database.rows()
    assert [r["envelope"]["payload"]["order_id"] for r in stored] == ["after"]


@pytest.fixture(params=list(CLIENTS))
async def bare_client(
    request: pytest.FixtureRequest,
    pg_databases: PgDatabases,
    mysql_databases: MysqlDatabases,
    tmp_path: Path,
) -> Any:
    """A client on a database ``router init-db`` never ran on."""
    kind, make = CLIENTS[request.param]
    made = make(await make_bare_database(kind, pg_databases, mysql_databases, tmp_path))
    yield made
    made.close()


async def make_bare_database(
    kind: str, pg_databases: PgDatabases, mysql_databases: MysqlDatabases, tmp_path: Path
) -> Database:
    """A database of ``kind`` without the router's tables."""
    if kind == "postgresql":
        return Database(kind, await pg_databases.new(migrated=False), tmp_path)
    if kind == "mysql":
        return Database(kind, await mysql_databases.new(migrated=False), tmp_path)
    return Database(kind, "sqlite:///outbox.db", tmp_path)


async def test_a_database_without_the_router_tables_is_refused_naming_init_db(
    bare_client: Client,
) -> None:
    # On PostgreSQL too the caller's transaction goes on: stage() asked for the tables
    # before an INSERT that would have failed and aborted it.
    await bare_client.database.execute(CALLER_TABLE)
    outbox = bare_client.outbox()
    with bare_client.transaction() as conn:
        execute(conn, "INSERT INTO caller_orders (id) VALUES ('before')")
        with pytest.raises(StagingError) as refused:
            outbox.stage(conn, StockReserved(order_id="o", quantity=1))
        assert str(refused.value) == NO_TABLES
        execute(conn, "INSERT INTO caller_orders (id) VALUES ('after')")
    found = await bare_client.database.fetch("SELECT id FROM caller_orders")
    assert sorted(row["id"] for row in found) == ["after", "before"]


@pytest.mark.parametrize(
    "client", [name for name, (kind, _) in CLIENTS.items() if kind == "postgresql"], indirect=True
)
async def test_the_tables_are_asked_for_once_per_database_and_process(client: Client) -> None:
    # Found once, the tables are not asked for again, by this outbox or another on the same
    # database: gone since, the INSERT itself fails, and aborts the transaction.
    first = client.outbox()
    with client.transaction() as conn:
        first.stage(conn, StockReserved(order_id="o-1", quantity=1))
    await client.database.execute("ALTER TABLE router_outbox RENAME TO router_outbox_gone")
    for outbox in (first, client.outbox()):
        with pytest.raises(StagingError) as refused, client.transaction() as conn:
            outbox.stage(conn, StockReserved(order_id="o-2", quantity=1))
        assert str(refused.value) == NO_TABLES + PG_ABORTED


@pytest.mark.parametrize("name", ["psycopg", "session-psycopg", "psycopg2", "session-pymysql"])
async def test_a_role_without_the_grant_is_refused_naming_it_and_the_transaction_goes_on(
    grantees: Grantees, name: str
) -> None:
    # On PostgreSQL the INSERT would have failed and aborted the caller's transaction: the
    # first stage() asks whether the role may insert, with the tables. MariaDB fails the
    # statement alone. Either way the message's GRANTs are all it takes.
    kind, make = CLIENTS[name]
    grantee = await grantees.new(kind)
    client = make(grantee.database)
    outbox = client.outbox()
    try:
        with client.transaction() as conn:
            execute(conn, "INSERT INTO caller_orders (id) VALUES ('before')")
            with pytest.raises(StagingError) as refused:
                outbox.stage(conn, StockReserved(order_id="o", quantity=1), stream_key="o")
            execute(conn, "INSERT INTO caller_orders (id) VALUES ('after')")
        who = grantee.account if kind == "postgresql" else grantee.account.replace("%", "127.0.0.1")
        assert str(refused.value) == not_granted(kind, who)
        found = await grantee.owner.fetch("SELECT id FROM caller_orders")
        assert sorted(row["id"] for row in found) == ["after", "before"]
        await grantee.owner.execute(*grants_named(str(refused.value), grantee.account))
        with client.transaction() as conn:
            outbox.stage(conn, StockReserved(order_id="granted", quantity=1), stream_key="o")
    finally:
        client.close()
    stored = await grantee.owner.rows()
    assert [r["envelope"]["payload"]["order_id"] for r in stored] == ["granted"]
