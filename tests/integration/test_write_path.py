"""stage() against real databases (PostgreSQL, SQLite, MariaDB): rows per target, one NOTIFY at
commit, rollbacks, rejections, autocommit refused, keyed bulk staging, stream locks."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from router import Outbox, StagingError, correlation
from router._wakeup import WAKE_LOCK_NAMESPACE
from router.config import DatabaseSettings
from router.ops.migrate import upgrade
from router.write.mysql import MYSQL_MAX_STREAM_KEY
from tests.conftest import MEMORY_BROKERS, Grantees, MysqlDatabases, PgDatabases, make_config

# The database helper moved to tests/conftest.py; test_ordering and test_idle_claims import it
# from here.
from tests.conftest import Database as Database
from tests.conftest import database as database
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

BROKERS = MEMORY_BROKERS


def outbox_for(url: str, **outbox: Any) -> Outbox:
    return Outbox(make_config({"main": url}, BROKERS, outbox=outbox))


async def rows(url: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(url)
    try:
        records: list[asyncpg.Record] = await conn.fetch(
            "SELECT message_id::text, target, destination, event_type, stream_key, "
            "envelope::text, status, attempts FROM router_outbox ORDER BY seq"
        )
        return records
    finally:
        await conn.close()


async def test_published_event_makes_one_row_per_target_with_the_same_id(
    database: Database,
) -> None:
    outbox = database.outbox()
    async with outbox.transaction() as tx:
        ids = await tx.stage(OrderPlaced(order_id="o-1", total=Decimal("9.50")), stream_key="o-1")
    await outbox.close()

    stored = await database.rows()
    assert [r["target"] for r in stored] == ["events", "analytics", "billing"]
    assert {r["message_id"] for r in stored} == set(ids)
    assert {r["status"] for r in stored} == {"pending"}
    assert {r["stream_key"] for r in stored} == {"o-1"}
    assert [r["destination"] for r in stored] == ["order_placed"] * 3
    envelope = stored[0]["envelope"]
    assert envelope["payload"] == {"order_id": "o-1", "total": "9.50", "note": None}
    assert envelope["type"] == "order_placed" and envelope["version"] == 2


# Quotes, backslashes, the drivers' own placeholders, text beyond Latin-1 and beyond the BMP:
# MySQL's statement carries the envelope as a hex literal, PostgreSQL's as a parameter.
AWKWARD = 'o\'1 \\ "q" %s %(x)s {0} ; -- 注文 🚀 \u00e9'


@pytest.mark.parametrize(
    "keys",
    [["k"], [None], ["k", "k"], ["k", "j", None]],
    ids=["one-row", "no-key", "one-key-many-rows", "many-keys"],
)
async def test_an_envelope_of_awkward_text_is_stored_as_it_was_built(
    database: Database, keys: list[str | None]
) -> None:
    outbox = database.outbox()
    events = [StockReserved(order_id=f"{AWKWARD}-{i}", quantity=i) for i in range(len(keys))]
    async with outbox.transaction() as tx:
        await tx.stage(*events, stream_keys=keys)
    await outbox.close()

    stored = await database.rows()
    assert [r["envelope"]["payload"]["order_id"] for r in stored] == [e.order_id for e in events]
    assert [r["stream_key"] for r in stored] == keys


async def test_internal_only_event_makes_one_row(database: Database) -> None:
    outbox = database.outbox()
    async with outbox.transaction() as tx:
        await tx.stage(StockReserved(order_id="o-1", quantity=2))
    await outbox.close()
    assert [r["target"] for r in await database.rows()] == ["events"]


async def test_rolled_back_transaction_leaves_no_row(database: Database) -> None:
    outbox = database.outbox()
    with pytest.raises(RuntimeError, match="business rule"):
        async with outbox.transaction() as tx:
            await tx.stage(OrderPlaced(order_id="o-1", total=Decimal(1)))
            raise RuntimeError("business rule failed")
    await outbox.close()
    assert await database.rows() == []


async def test_stage_with_an_async_session_commits_with_the_session(database: Database) -> None:
    outbox = database.outbox()
    sessions = async_sessionmaker(outbox.engine(), class_=AsyncSession)
    with correlation("req-7"):
        async with sessions() as session, session.begin():
            await outbox.stage(session, StockReserved(order_id="o-2", quantity=1))
            assert await database.rows() == []  # not visible before commit
    await outbox.close()
    stored = await database.rows()
    assert len(stored) == 1
    assert stored[0]["envelope"]["correlation_id"] == "req-7"


async def test_stage_with_a_raw_asyncpg_connection(pg_url: str) -> None:
    # PostgreSQL only: stage() takes a raw asyncpg connection; other drivers go through SQLAlchemy.
    outbox = outbox_for(pg_url)
    conn = await asyncpg.connect(pg_url)
    try:
        with pytest.raises(StagingError, match="inside a transaction"):
            await outbox.stage(conn, StockReserved(order_id="o-3", quantity=1))
        async with conn.transaction():
            await outbox.stage(
                conn,
                OrderPlaced(order_id="o-3", total=Decimal(3)),
                StockReserved(order_id="o-3", quantity=1),
                stream_key="o-3",
                causation_id="cmd-1",
                headers={"tenant": "acme"},
            )
    finally:
        await conn.close()
    stored = await rows(pg_url)
    assert [r["event_type"] for r in stored] == ["order_placed"] * 3 + ["stock_reserved"]
    envelope = json.loads(stored[-1]["envelope"])
    assert envelope["causation_id"] == "cmd-1"
    assert envelope["headers"] == {"tenant": "acme"}


async def test_the_common_call_on_asyncpg_stores_what_the_general_way_stores(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One event with a stream key and nothing else goes a shorter way on a raw asyncpg
    connection once the tables were found; with a correlation id in the context it goes the
    general way. Each event's rows are the same but for the id, the time and that id."""
    shorter = Outbox._stage_one_on_asyncpg
    took: list[bool] = []

    async def spy(self: Outbox, *args: Any) -> list[str] | None:
        staged = await shorter(self, *args)
        took.append(staged is not None)
        return staged

    monkeypatch.setattr(Outbox, "_stage_one_on_asyncpg", spy)
    outbox = outbox_for(pg_url)
    conn = await asyncpg.connect(pg_url)
    event = OrderPlaced(order_id="o-9", total=Decimal(9))
    try:
        async with conn.transaction():  # the first call asks for the tables
            await outbox.stage(conn, StockReserved(order_id="o-0", quantity=1))
        async with conn.transaction():
            [plain] = await outbox.stage(conn, event, stream_key="o-9")
            with correlation("c-1"):
                [general] = await outbox.stage(conn, event, stream_key="o-9")
    finally:
        await conn.close()
    assert took == [False, True, False]  # the probe, the shorter way, the correlation id
    stored = await rows(pg_url)
    by_id: dict[str, list[tuple[Any, ...]]] = {}
    for r in stored:
        envelope = json.loads(r["envelope"])
        assert envelope.pop("id") == str(r["message_id"])
        envelope.pop("time")
        shape = (r["target"], r["destination"], r["event_type"], r["stream_key"])
        by_id.setdefault(str(r["message_id"]), []).append((*shape, envelope))
    assert [e.get("correlation_id") for *_, e in by_id[general]] == ["c-1"] * 3
    for *_, envelope in by_id[general]:
        del envelope["correlation_id"]
    assert by_id[plain] == by_id[general]
    assert [row[0] for row in by_id[plain]] == ["events", "analytics", "billing"]


async def test_notify_arrives_once_and_only_at_commit(pg_url: str) -> None:
    # PostgreSQL only: NOTIFY is PostgreSQL's; the other databases have no wake-up to check.
    listener = await asyncpg.connect(pg_url)  # an idle relay: it holds the wake locks
    received: list[str] = []
    await listener.add_listener("router_outbox", lambda *args: received.append(args[3]))
    for target in ("events", "analytics", "billing"):
        await listener.execute(
            "SELECT pg_advisory_lock($1, hashtext($2))", WAKE_LOCK_NAMESPACE, target
        )
    outbox = outbox_for(pg_url)
    try:
        async with outbox.transaction() as tx:
            await tx.stage(
                OrderPlaced(order_id="o-4", total=Decimal(4)),
                OrderPlaced(order_id="o-5", total=Decimal(5)),
            )
            await asyncio.sleep(0.2)
            assert received == []  # nothing before COMMIT
        with pytest.raises(RuntimeError):
            async with outbox.transaction() as tx:
                await tx.stage(StockReserved(order_id="o-6", quantity=1))
                raise RuntimeError
        for _ in range(50):
            if received:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
    finally:
        await outbox.close()
        await listener.close()
    assert received == ["analytics,billing,events"]


@pytest.mark.parametrize(
    ("event", "message"),
    [
        (OrderPlaced(order_id="x" * 400_000, total=Decimal(1)), "the limit"),
    ],
)
async def test_rejected_event_leaves_the_callers_transaction_usable(
    database: Database, event: OrderPlaced, message: str
) -> None:
    outbox = database.outbox()
    async with outbox.transaction() as tx:
        with pytest.raises(StagingError, match=message):
            await tx.stage(StockReserved(order_id="ok", quantity=1), event)
        # Nothing of the rejected call was written, and the transaction goes on.
        await tx.stage(StockReserved(order_id="after", quantity=1))
    await outbox.close()
    stored = await database.rows()
    assert [r["envelope"]["payload"]["order_id"] for r in stored] == ["after"]


CALLER_TABLE = "CREATE TABLE caller_orders (id VARCHAR(40))"
CALLER_INSERT = text("INSERT INTO caller_orders (id) VALUES ('o-1')")


async def test_refused_input_leaves_the_callers_session_to_commit_its_own_rows(
    database: Database,
) -> None:
    await database.execute(CALLER_TABLE)
    outbox = database.outbox(NATS_BROKERS)
    messages = []
    try:
        async with AsyncSession(outbox.engine()) as session, session.begin():
            for events, options, _ in REFUSED_INPUT:
                with pytest.raises(StagingError) as refused:
                    await outbox.stage(session, *events, **options)
                messages.append(str(refused.value))
            await session.execute(CALLER_INSERT)
            await outbox.stage(session, StockReserved(order_id="after", quantity=1))
    finally:
        await outbox.close()
    assert messages == [message for _, _, message in REFUSED_INPUT]
    assert await database.fetch("SELECT id FROM caller_orders") == [{"id": "o-1"}]
    assert [r["envelope"]["payload"]["order_id"] for r in await database.rows()] == ["after"]


async def test_refused_input_leaves_a_raw_asyncpg_transaction_usable(pg_url: str) -> None:
    outbox = Outbox(make_config({"main": pg_url}, NATS_BROKERS))
    conn = await asyncpg.connect(pg_url)
    try:
        async with conn.transaction():
            for events, options, message in REFUSED_INPUT:
                with pytest.raises(StagingError) as refused:
                    await outbox.stage(conn, *events, **options)
                assert str(refused.value) == message
            await outbox.stage(conn, StockReserved(order_id="after", quantity=1))
    finally:
        await conn.close()
    assert [json.loads(r["envelope"])["payload"]["order_id"] for r in await rows(pg_url)] == [
        "after"
    ]


def _caller_id(value: object) -> str:
    return str(getattr(value, "__name__", value))


Execute = Callable[[str], Awaitable[Any]]
"""Runs the caller's own SQL in its open transaction."""

Caller = Callable[[Outbox, str], AbstractAsyncContextManager[tuple[Any, Execute]]]
"""Opens the caller's transaction on the outbox's database (its URL): yields what to stage on
and how to run the caller's SQL; commits, or rolls back on error."""


@asynccontextmanager
async def in_session(outbox: Outbox, _url: str) -> AsyncIterator[tuple[Any, Execute]]:
    async with AsyncSession(outbox.engine()) as session, session.begin():
        yield session, lambda sql: session.execute(text(sql))


@asynccontextmanager
async def in_connection(outbox: Outbox, _url: str) -> AsyncIterator[tuple[Any, Execute]]:
    async with outbox.engine().begin() as conn:
        yield conn, lambda sql: conn.execute(text(sql))


@asynccontextmanager
async def in_asyncpg(_outbox: Outbox, url: str) -> AsyncIterator[tuple[Any, Execute]]:
    conn = await asyncpg.connect(url)
    try:
        async with conn.transaction():
            yield conn, conn.execute
    finally:
        await conn.close()


CALLERS = [
    ("postgresql", in_session),
    ("postgresql", in_connection),
    ("postgresql", in_asyncpg),
    ("sqlite", in_session),
    ("sqlite", in_connection),
    ("mysql", in_session),
    ("mysql", in_connection),
]


@pytest.fixture
async def bare_database(
    request: pytest.FixtureRequest,
    pg_databases: PgDatabases,
    mysql_databases: MysqlDatabases,
    tmp_path: Path,
) -> Database:
    """A database ``router init-db`` never ran on."""
    if request.param == "postgresql":
        return Database("postgresql", await pg_databases.new(migrated=False), tmp_path)
    if request.param == "mysql":
        return Database("mysql", await mysql_databases.new(migrated=False), tmp_path)
    return Database("sqlite", "sqlite:///outbox.db", tmp_path)


@pytest.mark.parametrize(
    ("bare_database", "caller"), CALLERS, indirect=["bare_database"], ids=_caller_id
)
async def test_a_database_without_the_router_tables_is_refused_naming_init_db(
    bare_database: Database, caller: Caller
) -> None:
    # On PostgreSQL too the caller's transaction goes on: stage() asked for the tables
    # before an INSERT that would have failed and aborted it.
    await bare_database.execute(CALLER_TABLE)
    outbox = bare_database.outbox()
    try:
        async with caller(outbox, bare_database.url) as (conn, execute):
            await execute("INSERT INTO caller_orders (id) VALUES ('before')")
            with pytest.raises(StagingError) as refused:
                await outbox.stage(conn, StockReserved(order_id="o", quantity=1))
            assert str(refused.value) == NO_TABLES
            await execute("INSERT INTO caller_orders (id) VALUES ('after')")
    finally:
        await outbox.close()
    found = await bare_database.fetch("SELECT id FROM caller_orders")
    assert sorted(row["id"] for row in found) == ["after", "before"]


@pytest.mark.parametrize("caller", [in_session, in_connection, in_asyncpg], ids=_caller_id)
async def test_the_tables_are_asked_for_once_per_database_and_process(
    pg_url: str, caller: Caller
) -> None:
    # Found once, the tables are not asked for again, by this outbox or another on the same
    # database: gone since, the INSERT itself fails, and aborts the transaction.
    first, second = outbox_for(pg_url), outbox_for(pg_url)
    try:
        async with counting(first) as statements, caller(first, pg_url) as (conn, _):
            await first.stage(conn, StockReserved(order_id="o-1", quantity=1))
            await first.stage(conn, StockReserved(order_id="o-2", quantity=1))
        admin = await asyncpg.connect(pg_url)
        try:
            await admin.execute("ALTER TABLE router_outbox RENAME TO router_outbox_gone")
        finally:
            await admin.close()
        for outbox in (first, second):
            with pytest.raises(StagingError) as refused:
                async with caller(outbox, pg_url) as (conn, _):
                    await outbox.stage(conn, StockReserved(order_id="o-3", quantity=1))
            assert str(refused.value) == NO_TABLES + PG_ABORTED
    finally:
        await first.close()
        await second.close()
    if caller is not in_asyncpg:  # the statements counted are SQLAlchemy's
        assert sum("to_regclass" in statement for statement in statements) == 1


@pytest.mark.parametrize(
    ("kind", "caller"), [c for c in CALLERS if c[0] != "sqlite"], ids=_caller_id
)
async def test_a_role_without_the_grant_is_refused_naming_it_and_the_transaction_goes_on(
    grantees: Grantees, kind: str, caller: Caller
) -> None:
    # PostgreSQL: asked with the tables, before an INSERT that would abort the transaction.
    # The message's GRANTs are all it takes (not remembered as a refusal).
    grantee = await grantees.new(kind)
    outbox = grantee.database.outbox()
    try:
        async with caller(outbox, grantee.database.url) as (conn, execute):
            await execute("INSERT INTO caller_orders (id) VALUES ('before')")
            with pytest.raises(StagingError) as refused:
                await outbox.stage(conn, StockReserved(order_id="o", quantity=1), stream_key="o")
            await execute("INSERT INTO caller_orders (id) VALUES ('after')")
        who = grantee.account if kind == "postgresql" else grantee.account.replace("%", "127.0.0.1")
        assert str(refused.value) == not_granted(kind, who)
        await grantee.owner.execute(*grants_named(str(refused.value), grantee.account))
        async with caller(outbox, grantee.database.url) as (conn, _):
            await outbox.stage(conn, StockReserved(order_id="granted", quantity=1), stream_key="o")
    finally:
        await outbox.close()
    found = await grantee.owner.fetch("SELECT id FROM caller_orders")
    assert sorted(row["id"] for row in found) == ["after", "before"]
    assert [r["envelope"]["payload"]["order_id"] for r in await grantee.owner.rows()] == ["granted"]


@pytest.mark.parametrize("caller", [in_session, in_asyncpg], ids=_caller_id)
async def test_a_grant_revoked_after_the_probe_is_explained(
    grantees: Grantees, caller: Caller
) -> None:
    # Asked once per database and process: revoked since, the INSERT fails and aborts the
    # transaction, and the message says what to grant and to roll back.
    grantee = await grantees.new("postgresql")
    await grantee.owner.execute(f"GRANT INSERT ON router_outbox TO {grantee.account}")
    outbox = grantee.database.outbox()
    try:
        async with caller(outbox, grantee.database.url) as (conn, _):
            await outbox.stage(conn, StockReserved(order_id="o-1", quantity=1))
        await grantee.owner.execute(f"REVOKE INSERT ON router_outbox FROM {grantee.account}")
        with pytest.raises(StagingError) as refused:
            async with caller(outbox, grantee.database.url) as (conn, _):
                await outbox.stage(conn, StockReserved(order_id="o-2", quantity=1))
    finally:
        await outbox.close()
    assert str(refused.value) == (
        "database 'main': the connection's role may not insert into router_outbox: run "
        "`GRANT INSERT ON router_outbox TO <role> (its current_user)` as the table's owner"
        + PG_ABORTED
    )


async def test_a_refusal_is_not_remembered_so_staging_works_after_init_db(
    pg_databases: PgDatabases, tmp_path: Path
) -> None:
    url = await pg_databases.new(migrated=False)
    outbox = outbox_for(url)
    try:
        with pytest.raises(StagingError, match="run `router init-db`"):
            async with outbox.transaction() as tx:
                await tx.stage(StockReserved(order_id="early", quantity=1))
        await upgrade("main", DatabaseSettings.model_validate({"url": url}), tmp_path)
        async with outbox.transaction() as tx:
            await tx.stage(StockReserved(order_id="o-1", quantity=1))
    finally:
        await outbox.close()
    stored = await rows(url)
    assert [json.loads(r["envelope"])["payload"]["order_id"] for r in stored] == ["o-1"]


async def test_a_published_event_no_broker_takes_is_rejected(database: Database) -> None:
    outbox = database.outbox({"partner": {"type": "memory", "events": {"include": ["billing.*"]}}})
    async with outbox.transaction() as tx:
        with pytest.raises(StagingError, match="has no target"):
            await tx.stage(OrderPlaced(order_id="o", total=Decimal(1)))
    await outbox.close()
    assert await database.rows() == []


async def test_a_stream_key_longer_than_mysql_keeps_is_rejected_before_anything_is_written(
    mysql_url: str, tmp_path: Path
) -> None:
    # MySQL indexes stream keys, so it keeps them up to a length; PostgreSQL and SQLite do not.
    database = Database("mysql", mysql_url, tmp_path)
    outbox = database.outbox()
    async with outbox.transaction() as tx:
        with pytest.raises(StagingError, match=f"at most {MYSQL_MAX_STREAM_KEY}"):
            await tx.stage(
                StockReserved(order_id="long", quantity=1),
                stream_key="k" * (MYSQL_MAX_STREAM_KEY + 1),
            )
        await tx.stage(
            StockReserved(order_id="longest", quantity=1), stream_key="k" * MYSQL_MAX_STREAM_KEY
        )
    await outbox.close()
    assert [len(r["stream_key"]) for r in await database.rows()] == [MYSQL_MAX_STREAM_KEY]


AUTOCOMMIT = "AUTOCOMMIT"
REFUSED = (
    r"^stage\(\) needs the connection inside a transaction, but it runs in AUTOCOMMIT "
    r"\(isolation_level='AUTOCOMMIT'\), so each statement would commit on its own, apart "
    r"from the caller's work; stage on a connection without AUTOCOMMIT, in a transaction "
    r"\(async with session.begin\(\): \.\.\. or async with engine.begin\(\) as "
    r"connection: \.\.\.\)$"
)


async def stage_on_autocommit_engine(outbox: Outbox) -> None:
    async with outbox.engine(isolation_level=AUTOCOMMIT).connect() as conn:
        await outbox.stage(conn, StockReserved(order_id="o", quantity=1))


async def stage_on_autocommit_connection(outbox: Outbox) -> None:
    async with outbox.engine().connect() as conn:
        await conn.execution_options(isolation_level=AUTOCOMMIT)
        await outbox.stage(conn, StockReserved(order_id="o", quantity=1))


async def stage_on_autocommit_session(outbox: Outbox) -> None:
    bind = outbox.engine().execution_options(isolation_level=AUTOCOMMIT)
    async with AsyncSession(bind) as session, session.begin():
        await outbox.stage(session, StockReserved(order_id="o", quantity=1))


@pytest.mark.parametrize(
    "stage_in_autocommit",
    [stage_on_autocommit_engine, stage_on_autocommit_connection, stage_on_autocommit_session],
    ids=["engine", "connection", "session"],
)
async def test_stage_refuses_a_connection_in_autocommit_and_writes_nothing(
    database: Database, stage_in_autocommit: Any
) -> None:
    outbox = database.outbox()
    try:
        with pytest.raises(StagingError, match=REFUSED):
            await stage_in_autocommit(outbox)
    finally:
        await outbox.close()
    assert await database.rows() == []


async def test_a_transaction_sqlalchemy_autobegins_is_a_transaction_stage_accepts(
    database: Database,
) -> None:
    outbox = database.outbox()
    try:
        async with AsyncSession(outbox.engine()) as session:
            await outbox.stage(session, StockReserved(order_id="autobegun", quantity=1))
            await session.rollback()  # it is the caller's transaction: rolling back undoes it
            await outbox.stage(session, StockReserved(order_id="committed", quantity=1))
            await session.commit()
        async with outbox.engine().connect() as conn:
            await outbox.stage(conn, StockReserved(order_id="connection", quantity=1))
            await conn.commit()
    finally:
        await outbox.close()
    stored = await database.rows()
    assert [r["envelope"]["payload"]["order_id"] for r in stored] == ["committed", "connection"]


def key_of(i: int) -> str | None:
    """The stream key of the i-th event of the bulk tests: 97 streams, interleaved, and
    every tenth event without one."""
    return None if i % 10 == 9 else f"stream-{i % 97}"


BULK = 1000


async def bulk_via_asyncpg(outbox: Outbox, database: Database, **options: Any) -> int:
    statements: list[str] = []
    conn = await asyncpg.connect(database.url)
    conn.add_query_logger(lambda record: statements.append(record.query))
    try:
        async with conn.transaction():
            await outbox.stage(conn, *bulk_events(), **options)
    finally:
        await conn.close()
    return inserts(statements)


async def bulk_via_connection(outbox: Outbox, database: Database, **options: Any) -> int:
    async with counting(outbox) as statements, outbox.engine().begin() as conn:
        await outbox.stage(conn, *bulk_events(), **options)
    return inserts(statements)


async def bulk_via_session(outbox: Outbox, database: Database, **options: Any) -> int:
    sessions = async_sessionmaker(outbox.engine(), class_=AsyncSession)
    async with counting(outbox) as statements, sessions() as session, session.begin():
        await outbox.stage(session, *bulk_events(), **options)
    return inserts(statements)


async def bulk_via_transaction(outbox: Outbox, database: Database, **options: Any) -> int:
    async with counting(outbox) as statements, outbox.transaction() as tx:
        await tx.stage(*bulk_events(), **options)
    return inserts(statements)


def bulk_events() -> list[StockReserved]:
    return [StockReserved(order_id=f"o-{i}", quantity=i) for i in range(BULK)]


def inserts(statements: list[str]) -> int:
    return sum("INSERT INTO router_outbox" in statement for statement in statements)


@asynccontextmanager
async def counting(outbox: Outbox) -> AsyncIterator[list[str]]:
    """The statements the outbox's engine sends while the block runs."""
    statements: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        statements.append(statement)

    engine = outbox.engine().sync_engine
    event.listen(engine, "before_cursor_execute", record)
    try:
        yield statements
    finally:
        event.remove(engine, "before_cursor_execute", record)


@pytest.mark.parametrize(
    ("database", "stage_in_bulk"),
    [
        ("postgresql", bulk_via_asyncpg),
        ("postgresql", bulk_via_connection),
        ("postgresql", bulk_via_session),
        ("postgresql", bulk_via_transaction),
        ("sqlite", bulk_via_connection),
        ("sqlite", bulk_via_session),
        ("sqlite", bulk_via_transaction),
        ("mysql", bulk_via_connection),
        ("mysql", bulk_via_session),
        ("mysql", bulk_via_transaction),
    ],
    indirect=["database"],
    ids=lambda value: getattr(value, "__name__", value),
)
async def test_stream_keys_stage_many_streams_in_one_insert_in_order_per_stream(
    database: Database, stage_in_bulk: Any
) -> None:
    keys = [key_of(i) for i in range(BULK)]
    outbox = database.outbox()
    try:
        statements = await stage_in_bulk(outbox, database, stream_keys=keys)
    finally:
        await outbox.close()

    stored = await database.rows()
    assert statements == 1
    assert len(stored) == BULK
    for row in stored:
        i = row["envelope"]["payload"]["quantity"]
        assert row["stream_key"] == keys[i]
        assert row["envelope"].get("stream") == keys[i]
    per_stream: dict[str | None, list[int]] = {}
    for row in stored:
        per_stream.setdefault(row["stream_key"], []).append(row["envelope"]["payload"]["quantity"])
    assert len(per_stream) == 98  # 97 streams and the events without one
    assert per_stream == {key: [i for i in range(BULK) if keys[i] == key] for key in set(keys)}


async def test_stream_keys_of_unequal_length_are_refused_and_nothing_is_written(
    database: Database,
) -> None:
    outbox = database.outbox()
    try:
        async with outbox.transaction() as tx:
            with pytest.raises(StagingError, match="stream_keys has length 2 for 3 events"):
                await tx.stage(*bulk_events()[:3], stream_keys=["a", "b"])
            with pytest.raises(StagingError, match="stream_key .* or stream_keys .*, not both"):
                await tx.stage(*bulk_events()[:2], stream_key="a", stream_keys=["a", "b"])
    finally:
        await outbox.close()
    assert await database.rows() == []


@pytest.mark.parametrize(
    "database",
    # Not SQLite: it has one writer, so the second transaction waits for the first whatever
    # its stream keys.
    ["postgresql", "mysql"],
    indirect=True,
)
async def test_stream_keys_lock_every_stream_of_the_call_until_it_commits(
    database: Database,
) -> None:
    # A second transaction staging on any one of the first's streams waits for its commit,
    # so its row comes after the first's in seq order: per-stream commit order holds.
    outbox = database.outbox()
    engine = outbox.engine()
    try:
        async with engine.connect() as first, engine.connect() as second:
            open_tx = await first.begin()
            await outbox.stage(
                first,
                *[StockReserved(order_id=f"first-{k}", quantity=1) for k in "abc"],
                stream_keys=["a", "b", "c"],
            )

            async def stage_later(key: str) -> None:
                async with second.begin():
                    await outbox.stage(
                        second, StockReserved(order_id=f"second-{key}", quantity=2), stream_key=key
                    )

            # A stream the first transaction did not stage on is not held up...
            await asyncio.wait_for(stage_later("d"), 5)
            later = asyncio.create_task(stage_later("c"))
            await asyncio.sleep(0.3)
            assert not later.done()  # ...but "c" is: it waits for the first transaction
            await open_tx.commit()
            await asyncio.wait_for(later, 5)
    finally:
        await outbox.close()
    order_ids = [r["envelope"]["payload"]["order_id"] for r in await database.rows()]
    assert order_ids == ["first-a", "first-b", "first-c", "second-d", "second-c"]


@pytest.mark.parametrize("database", ["postgresql", "mysql"], indirect=True)
async def test_a_rolled_back_transaction_releases_its_streams(database: Database) -> None:
    outbox = database.outbox()
    engine = outbox.engine()
    try:
        async with engine.connect() as first, engine.connect() as second:
            open_tx = await first.begin()
            await outbox.stage(first, StockReserved(order_id="undone", quantity=1), stream_key="a")

            async def stage_later() -> None:
                async with second.begin():
                    await outbox.stage(
                        second, StockReserved(order_id="after", quantity=2), stream_key="a"
                    )

            later = asyncio.create_task(stage_later())
            await asyncio.sleep(0.3)
            assert not later.done()
            await open_tx.rollback()
            await asyncio.wait_for(later, 5)
    finally:
        await outbox.close()
    assert [r["envelope"]["payload"]["order_id"] for r in await database.rows()] == ["after"]
