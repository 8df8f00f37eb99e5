"""Events raised by ORM entities, staged when the session flushes (``stage_on_flush``), on
sync and async SQLAlchemy sessions against real PostgreSQL, MariaDB and SQLite."""

from __future__ import annotations

import gc
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from router import Event, RaisesEvents, StagingError, SyncOutbox
from tests.conftest import MEMORY_BROKERS, Database, MysqlDatabases, PgDatabases, make_config
from tests.conftest import make_database as make_database


class Base(DeclarativeBase):
    pass


class Order(Base, RaisesEvents):
    __tablename__ = "shop_orders"

    id: Mapped[str] = mapped_column(sa.String(36), primary_key=True)
    total: Mapped[int]


class OrderPlaced(Event, type="entity.order_placed", published=True):
    order_id: str


class OrderPaid(Event, type="entity.order_paid"):
    order_id: str


def new_order(total: int = 10) -> Order:
    return Order(id=str(uuid.uuid4()), total=total)


@dataclass
class Sessions:
    """Run ``work(session)`` in one transaction of a tracked session, sync or async (an
    async session hands ``work`` its sync side, in its own greenlet, as ``run_sync`` does)."""

    database: Database
    run: Callable[[Callable[[Session], None]], Any]  # awaitable


SYNC_DRIVERS = {"postgresql": "psycopg", "mysql": "pymysql", "sqlite": "pysqlite"}


def sync_url(database: Database) -> str:
    if database.kind == "sqlite":
        return f"sqlite+pysqlite:///{database.base_dir / 'outbox.db'}"
    return database.url.replace("://", f"+{SYNC_DRIVERS[database.kind]}://", 1)


def async_url(database: Database) -> str:
    outbox = database.outbox()
    return outbox.engine().url.render_as_string(hide_password=False)


@pytest.fixture(
    params=[
        ("postgresql", "sync"),
        ("postgresql", "async"),
        ("mysql", "sync"),
        ("sqlite", "sync"),
        ("sqlite", "async"),
    ],
    ids=lambda p: "-".join(p),
)
async def sessions(
    request: pytest.FixtureRequest,
    pg_databases: PgDatabases,
    mysql_databases: MysqlDatabases,
    tmp_path: Path,
) -> AsyncIterator[Sessions]:
    kind, mode = request.param
    database = await make_database(kind, pg_databases, mysql_databases, tmp_path)
    outbox = SyncOutbox(
        make_config({"main": database.url}, MEMORY_BROKERS, base_dir=database.base_dir)
    )
    if mode == "sync":
        engine = sa.create_engine(sync_url(database))
        Base.metadata.create_all(engine)
        maker = sessionmaker(engine, expire_on_commit=False)
        outbox.stage_on_flush(maker)

        async def run_sync(work: Callable[[Session], None]) -> None:
            with maker() as session, session.begin():
                work(session)

        yield Sessions(database, run_sync)
        engine.dispose()
        return
    async_engine = create_async_engine(async_url(database))
    async with async_engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    async_maker = async_sessionmaker(async_engine, expire_on_commit=False)
    outbox.stage_on_flush(async_maker)

    async def run_async(work: Callable[[Session], None]) -> None:
        async with async_maker() as session, session.begin():
            await session.run_sync(work)  # the same work, on the async session's sync side

    yield Sessions(database, run_async)
    await async_engine.dispose()


async def staged(database: Database) -> list[tuple[str, str | None, dict[str, Any]]]:
    return [
        (r["event_type"], r["stream_key"], r["envelope"]["payload"])
        for r in await database.rows()
        if r["target"] == "events"
    ]


async def test_a_new_entitys_events_are_staged_at_commit_in_raise_order(
    sessions: Sessions,
) -> None:
    order = new_order()

    def place(session: Session) -> None:
        order.raise_event(OrderPlaced(order_id=order.id))
        order.raise_event(OrderPaid(order_id=order.id))
        session.add(order)

    await sessions.run(place)
    assert await staged(sessions.database) == [
        ("entity.order_placed", order.id, {"order_id": order.id}),
        ("entity.order_paid", order.id, {"order_id": order.id}),
    ]
    assert order.raised_events == []
    targets = [r["target"] for r in await sessions.database.rows()]
    assert targets == ["events", "analytics", "billing", "events"]


async def test_raise_order_holds_across_entities_and_an_explicit_stream_key_wins(
    sessions: Sessions,
) -> None:
    first, second = new_order(), new_order()

    def place(session: Session) -> None:
        second.raise_event(OrderPlaced(order_id=second.id))
        first.raise_event(OrderPlaced(order_id=first.id))
        second.raise_event(OrderPaid(order_id=second.id), stream_key="payments")
        session.add_all([first, second])

    await sessions.run(place)
    assert [(t, k) for t, k, _ in await staged(sessions.database)] == [
        ("entity.order_placed", second.id),
        ("entity.order_placed", first.id),
        ("entity.order_paid", "payments"),
    ]


async def test_a_rolled_back_transaction_stages_nothing(sessions: Sessions) -> None:
    order = new_order()

    def fail(session: Session) -> None:
        order.raise_event(OrderPlaced(order_id=order.id))
        session.add(order)
        session.flush()  # staged by now, and rolled back with the order
        raise RuntimeError("business rule")

    with pytest.raises(RuntimeError, match="business rule"):
        await sessions.run(fail)
    assert await sessions.database.rows() == []


async def test_an_entity_saved_twice_stages_its_events_once(sessions: Sessions) -> None:
    order = new_order()

    def place(session: Session) -> None:
        order.raise_event(OrderPlaced(order_id=order.id))
        session.add(order)

    await sessions.run(place)
    await sessions.run(lambda session: setattr(session.merge(order), "total", 20))
    assert [t for t, _, _ in await staged(sessions.database)] == ["entity.order_placed"]


async def test_an_unchanged_entitys_events_are_staged_at_commit(sessions: Sessions) -> None:
    order = new_order()
    await sessions.run(lambda session: session.add(order))

    def pay(session: Session) -> None:
        loaded = session.merge(order, load=False)
        loaded.raise_event(OrderPaid(order_id=loaded.id))  # no column changes

    await sessions.run(pay)
    assert await staged(sessions.database) == [
        ("entity.order_paid", order.id, {"order_id": order.id}),
    ]


def test_raise_event_takes_only_events() -> None:
    with pytest.raises(StagingError, match="raise_event\\(\\) takes a router.Event"):
        new_order().raise_event({"order_id": "o"})  # type: ignore[arg-type]


def test_stage_on_flush_names_what_it_takes(tmp_path: Path) -> None:
    outbox = SyncOutbox(make_config({"main": "sqlite:///x.db"}, MEMORY_BROKERS, base_dir=tmp_path))
    with pytest.raises(StagingError, match="takes a SQLAlchemy Session"):
        outbox.stage_on_flush(object())


def placed_order() -> Order:
    """A factory that builds an order and raises its event; the caller keeps no reference."""
    order = new_order()
    order.raise_event(OrderPaid(order_id=order.id))
    return order


async def test_events_raised_before_add_survive_with_no_reference_kept(
    sessions: Sessions,
) -> None:
    def place(session: Session) -> None:
        for _ in range(5_000):
            session.add(placed_order())
        gc.collect()
        session.flush()  # after it SQLAlchemy holds the orders only weakly
        gc.collect()

    await sessions.run(place)
    rows = await staged(sessions.database)
    assert len(rows) == 5_000
    ids = {row["id"] for row in await sessions.database.fetch("SELECT id FROM shop_orders")}
    assert {key for _, key, _ in rows} == ids


async def test_a_retry_after_a_rollback_stages_the_events_again(sessions: Sessions) -> None:
    order = new_order()
    order.raise_event(OrderPlaced(order_id=order.id))

    def attempt(session: Session) -> None:
        session.add(order)
        session.flush()  # staged, then rolled back with the order
        raise RuntimeError("serialization failure")

    with pytest.raises(RuntimeError, match="serialization failure"):
        await sessions.run(attempt)
    assert [type(e) for e in order.raised_events] == [OrderPlaced]
    await sessions.run(lambda session: session.add(order))  # the retry
    assert [(t, k) for t, k, _ in await staged(sessions.database)] == [
        ("entity.order_placed", order.id)
    ]
    assert order.raised_events == []


async def test_a_rolled_back_savepoint_puts_back_only_its_own_events(
    sessions: Sessions,
) -> None:
    first, second = new_order(), new_order()

    def work(session: Session) -> None:
        first.raise_event(OrderPaid(order_id=first.id))
        session.add(first)
        session.flush()  # staged in the transaction itself
        savepoint = session.begin_nested()
        second.raise_event(OrderPaid(order_id=second.id))
        session.add(second)
        session.flush()  # staged in the savepoint
        savepoint.rollback()
        assert len(second.raised_events) == 1 and first.raised_events == []
        session.add(second)  # the retry, in the transaction

    await sessions.run(work)
    assert [k for _, k, _ in await staged(sessions.database)] == [first.id, second.id]


async def test_a_session_stage_on_flush_never_saw_refuses_to_drop_events(
    sessions: Sessions,
) -> None:
    engine = sa.create_engine(sync_url(sessions.database))
    order = placed_order()
    never_given = pytest.raises(StagingError, match="stage_on_flush\\(\\) was never given")
    with never_given, Session(engine) as session, session.begin():
        session.add(order)
    loaded = new_order().id
    with Session(engine) as session, session.begin():
        session.add(Order(id=loaded, total=1))
    never_given = pytest.raises(StagingError, match="stage_on_flush\\(\\) was never given")
    with never_given, Session(engine) as session, session.begin():
        unchanged = session.get(Order, loaded)
        assert unchanged is not None
        unchanged.raise_event(OrderPaid(order_id=loaded))  # no column changes
    engine.dispose()
    assert await sessions.database.rows() == []
    orders = await sessions.database.fetch("SELECT id FROM shop_orders")
    assert [row["id"] for row in orders] == [loaded]  # the refused one rolled back
    assert len(order.raised_events) == 1  # still waiting, for a tracked session


def test_an_entity_dropped_with_events_waiting_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="router.write.entities")
    gc.collect()  # what other tests dropped
    caplog.clear()
    order = placed_order()
    del order
    gc.collect()
    [record] = [r for r in caplog.records if r.getMessage() == "router.entity.events_unstaged"]
    assert record.events == "entity.order_paid"  # type: ignore[attr-defined]
    caplog.clear()
    staged_order = new_order()
    del staged_order  # raised nothing: nothing to say
    gc.collect()
    assert caplog.records == []
