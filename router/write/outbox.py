"""``Outbox``: what application code uses to stage events in its own transaction.

    outbox = Outbox.from_file("config.yaml")

    async with session.begin():
        session.add(order)
        await outbox.stage(session, OrderPlaced(order_id=order.id), stream_key=order.id)

``stage`` takes a SQLAlchemy ``AsyncSession`` or ``AsyncConnection``, or a raw asyncpg
connection inside a transaction. For code without a transaction of its own::

    async with outbox.transaction() as tx:
        await tx.connection.execute(...)
        await tx.stage(OrderPlaced(...))
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn, Unpack

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.pool import NullPool

from envelopes import StageOptions, StagingError
from router._db import create_engine
from router._local import announce, listening
from router.config import RouterConfig
from router.write._tracing import current_traceparent
from router.write.async_drivers import AsyncpgDriver, async_driver, insert, is_asyncpg
from router.write.checks import (
    SCHEMA_PROBE,
    check_schema_probe,
    needs_schema_probe,
    table_refusal,
)
from router.write.events import Event, current_correlation_id
from router.write.statements import Row, Statement
from router.write.units import Unit, atomic_targets, unit_count
from router.write.writer import Writer, message_ids

__all__ = ["Outbox", "Transaction"]


class Outbox(Writer):
    """Stages events as outbox rows, one per target, in the caller's transaction (async:
    ``SyncOutbox`` is its twin for sync code)."""

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self._engines: dict[str, AsyncEngine] = {}
        self._made_with: dict[str, dict[str, Any]] = {}
        self._loops: dict[str, asyncio.AbstractEventLoop | None] = {}
        # The databases whose common call may go the short way (_stage_one_on_asyncpg),
        # each with whether it notifies.
        self._short: dict[str, bool] = {}

    async def stage(
        self,
        connection: AsyncSession | AsyncConnection | Any,
        *events: Event,
        database: str | None = None,
        stream_key: str | None = None,
        stream_keys: Sequence[str | None] | None = None,
        **options: Unpack[StageOptions],
    ) -> list[str]:
        """Write ``events`` to the outbox in ``connection``'s transaction; returns their ids.

        ``stream_key`` is every event's stream; ``stream_keys`` gives one per event instead
        (None for none), so events of many streams go in one INSERT, each stream's in the
        order given. ``options`` is the metadata every envelope of the call carries
        (``correlation_id``, ``causation_id``, ``headers``, ``extensions``, ``tenant``, ...:
        the fields of ``envelopes.StageOptions``).

        Raises ``StagingError`` (having written nothing) if an event cannot be serialised, is
        larger than ``outbox.max_payload_bytes``, or has no target. The correlation id defaults
        to the one set with ``router.correlation()``, the traceparent to the active
        OpenTelemetry span's (when OpenTelemetry is installed).
        """
        if not events and not stream_keys:  # keys without events: build_rows says why
            return []
        name = self._database(database)
        if len(events) == 1 and not options and stream_keys is None and is_asyncpg(connection):
            staged = await self._stage_one_on_asyncpg(connection, name, events[0], stream_key)
            if staged is not None:
                return staged
        rows = self._rows(name, events, stream_key, stream_keys, options)
        await self._insert(connection, name, rows)
        return message_ids(rows)

    async def _stage_one_on_asyncpg(
        self, connection: Any, name: str, event: Event, stream_key: str | None
    ) -> list[str] | None:
        """``stage()``'s most common call, one event with a stream key or none and nothing
        else, on a raw asyncpg connection: the rows and statement the general way makes, run
        by the same driver without the rest of its layers (the driver's lookup, the unit
        bookkeeping, the statement loop), whose small calls in a loop of commits cost as much
        again as the rest of the call (#39). None when the call needs more than that (a
        first call's schema probe, an atomic target, a correlation id or trace in the
        context): the general way then does it."""
        notify = self._short.get(name)
        if notify is None:
            settings = self.config.databases[name]
            if (
                settings.kind != "postgresql"
                or needs_schema_probe("postgresql", settings)
                or self._stager.atomic_limits(name)
            ):
                return None
            # The tables once found are not asked for again (needs_schema_probe), and the
            # rest is the config's: the answer holds for the process.
            notify = self._short[name] = settings.notifies
        if current_correlation_id() is not None or current_traceparent() is not None:
            return None
        rows = self._stager.build_rows(name, (event,), stream_key=stream_key)
        driver = AsyncpgDriver(connection)  # StagingError outside a transaction, as always
        [statement] = self._stager.statements("postgresql", rows, notify=notify)
        assert isinstance(statement, Statement)
        try:
            await driver.execute(statement)
        except Exception as exc:
            _reraise(exc, name, "postgresql")
        return [rows[0].message_id]

    async def _insert(self, connection: Any, name: str, rows: Sequence[Row]) -> None:
        """One INSERT of ``rows`` in the caller's transaction, refused outside of one."""
        database = self.config.databases[name]
        driver = await async_driver(connection)
        self._expect(name, database.kind, driver.dialect)
        if needs_schema_probe(driver.dialect, database):
            check_schema_probe(await driver.scalar(SCHEMA_PROBE), database, name)
        unit: Unit | None = None
        targets = atomic_targets(rows, self._stager.atomic_limits(name))
        if targets:
            unit = await driver.unit()
            staged = (
                unit.staged
                if unit is not None
                else {t: await driver.scalar(unit_count(t)) for t in targets}
            )
            adding = self._join_unit(name, driver.dialect, rows, unit, staged)
        statements = self._stager.statements(driver.dialect, rows, notify=database.notifies)
        try:
            await insert(driver, statements)
        except Exception as exc:
            _reraise(exc, name, driver.dialect)
        if unit is not None:
            unit.staged.update(adding)
        if isinstance(connection, AsyncSession):
            self._announce_after_commit(connection, name, rows)

    def engine(self, database: str | None = None, **kwargs: Any) -> AsyncEngine:
        """A SQLAlchemy engine for a configured database (SQLite: WAL and a busy timeout),
        made on the first call with ``kwargs`` (``create_async_engine``'s) and kept.

        A pooled engine's connections belong to the event loop that opened them, so the
        engine may not be used from another loop (Flask runs each ``async def`` view in a
        loop of its own): that is refused with what to do instead.
        """
        name = self._database(database)
        made = self._engines.get(name)
        if made is None:
            made = self._engines[name] = create_engine(
                self.config.databases[name], self.config.base_dir, name=name, **kwargs
            )
            self._made_with[name] = kwargs
            self._loops[name] = _running_loop()
            return made
        if kwargs and kwargs != self._made_with[name]:
            raise ValueError(
                f"the engine of database {name!r} exists already, made with "
                f"{sorted(self._made_with[name]) or 'no options'}; pass its options on the "
                "first call to engine() (or none later)"
            )
        self._check_loop(name, made)
        return made

    def _check_loop(self, name: str, engine: AsyncEngine) -> None:
        made_on, now = self._loops.get(name), _running_loop()
        if made_on is None:  # made outside any loop: the first loop to use it owns it
            self._loops[name] = now
            return
        if now is None or made_on is now or isinstance(engine.pool, NullPool):
            return
        raise StagingError(
            f"the engine of database {name!r} was made on another event loop, and its pooled "
            "connections belong to that loop (Flask runs each async view in a new loop). "
            "In a sync framework, stage with SyncOutbox on its own session; or make this "
            "engine unpooled once, before the first request: "
            "outbox.engine(poolclass=sqlalchemy.pool.NullPool)"
        )

    @asynccontextmanager
    async def transaction(self, database: str | None = None) -> AsyncIterator[Transaction]:
        """A unit of work: commits on success, rolls back (staging nothing) on error."""
        name = self._database(database)
        async with self.engine(name).begin() as conn:
            tx = Transaction(self, conn, name)
            yield tx
        if tx.targets:
            announce(self._key(name), tx.targets)

    def _announce_after_commit(
        self, session: AsyncSession, database: str, rows: Sequence[Row]
    ) -> None:
        """In-process fast path: wake local processors once the session commits."""
        key = self._key(database)
        if not listening(key):
            return
        targets = {row.target for row in rows}
        event.listen(
            session.sync_session, "after_commit", lambda _session: announce(key, targets), once=True
        )

    async def close(self) -> None:
        """Dispose the engines this outbox created."""
        engines, self._engines = self._engines, {}
        self._made_with.clear()
        self._loops.clear()
        for engine in engines.values():
            await engine.dispose()


@dataclass(slots=True)
class Transaction:
    """An open unit of work from ``Outbox.transaction()``."""

    outbox: Outbox
    connection: AsyncConnection
    database: str
    targets: set[str] = field(default_factory=set)

    async def stage(
        self,
        *events: Event,
        stream_key: str | None = None,
        stream_keys: Sequence[str | None] | None = None,
        **options: Unpack[StageOptions],
    ) -> list[str]:
        """Stage events in this transaction (same options as ``Outbox.stage``)."""
        ids = await self.outbox.stage(
            self.connection,
            *events,
            database=self.database,
            stream_key=stream_key,
            stream_keys=stream_keys,
            **options,
        )
        self.targets.update(self.outbox.targets_of(self.database, events))
        return ids


def _reraise(error: Exception, database: str, dialect: str) -> NoReturn:
    """Raise ``error``, or ``StagingError`` saying what to do if it says the router's tables
    are missing or not granted (``router.write.checks.table_refusal``)."""
    refused = table_refusal(error, database, dialect)
    if refused is None:
        raise error
    raise refused from None


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
