"""What the async ``Outbox`` and the sync ``SyncOutbox`` share: everything but running the
statements. Rows are built and checked here, once (``Stager``: pure, no I/O), as httpx's
``Client`` and ``AsyncClient`` share one base; only the insert differs between the two."""

from __future__ import annotations

import functools
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Self

from envelopes import StageOptions, StagingError
from router._local import database_key
from router._yaml import load_config
from router.config import RouterConfig
from router.write._tracing import current_traceparent
from router.write.checks import (
    SCHEMA_PROBE,
    check_schema_probe,
    needs_schema_probe,
    table_refusal,
)
from router.write.drivers import sync_driver
from router.write.events import Event, current_correlation_id
from router.write.staging import Row, Stager
from router.write.statements import Statement
from router.write.units import Unit, atomic_targets, join_unit, unit_count

__all__ = ["Writer", "message_ids"]


class Writer:
    """The config, the row builder, and the checks of a ``stage()`` call before any I/O."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._stager = Stager(config)
        self._keys: dict[str, str] = {}

    @classmethod
    def from_file(cls, path: str | os.PathLike[str] | None = None) -> Self:
        """Load ``config.yaml`` (or ``$ROUTER_CONFIG``) and build an outbox from it.

        Staging reads no broker's credentials, so their variables (and ``http.token``'s) may
        be unset here; ``router serve`` and ``router check`` refuse them unset.
        """
        path = path or os.environ.get("ROUTER_CONFIG", "config.yaml")
        return cls(load_config(path, require_secrets=False))

    def stage_on_flush(self, sessions: Any, *, database: str | None = None) -> None:
        """Stage the events entities raised (``RaisesEvents.raise_event``) when ``sessions``
        flush, in the flush's transaction and in the order raised; each event's stream key is
        its entity's identity unless it was raised with one.

        ``sessions``: a SQLAlchemy ``Session`` (class or instance), ``sessionmaker``,
        ``scoped_session``, ``AsyncSession`` or ``async_sessionmaker``. An entity's events are
        staged once, at the first flush after they were raised; a rolled-back transaction
        stages nothing.
        """
        name = self._database(database)
        # Imported here: it needs SQLAlchemy's ORM, half a second of imports that a script
        # staging on a raw psycopg connection should not pay at its start.
        from router.write import entities

        entities.stage_on_flush(sessions, functools.partial(self._stage_sync, database=name))

    def _stage_sync(
        self,
        connection: Any,
        events: Sequence[Event],
        *,
        database: str | None = None,
        stream_key: str | None = None,
        stream_keys: Sequence[str | None] | None = None,
        options: StageOptions | None = None,
    ) -> list[str]:
        """``SyncOutbox.stage``: also what a flush of a tracked session runs, sync or async
        (an async session flushes in a sync context of its own)."""
        if not events and not stream_keys:  # keys without events: build_rows says why
            return []
        name = self._database(database)
        rows = self._rows(name, events, stream_key, stream_keys, options or {})
        driver = sync_driver(connection)
        settings = self.config.databases[name]
        self._expect(name, settings.kind, driver.dialect)
        if needs_schema_probe(driver.dialect, settings):
            check_schema_probe(driver.scalar(SCHEMA_PROBE), settings, name)
        unit: Unit | None = None
        targets = atomic_targets(rows, self._stager.atomic_limits(name))
        if targets:
            unit = driver.unit()
            staged = (
                unit.staged
                if unit is not None
                else {t: driver.scalar(unit_count(t)) for t in targets}
            )
            adding = self._join_unit(name, driver.dialect, rows, unit, staged)
        statements = self._stager.statements(
            driver.dialect,
            rows,
            copy=driver.copies,
            simple=driver.simple,
            notify=settings.notifies,
        )
        try:
            for statement in statements:
                written = driver.execute(statement)
                if written == 0 and isinstance(statement, Statement) and statement.repair:
                    driver.execute(statement.repair)
                    driver.execute(statement)
        except Exception as exc:
            refused = table_refusal(exc, name, driver.dialect)
            if refused is None:
                raise
            raise refused from None
        if unit is not None:
            unit.staged.update(adding)
        return message_ids(rows)

    def _join_unit(
        self,
        database: str,
        dialect: str,
        rows: Sequence[Row],
        unit: Unit | None,
        staged: Mapping[str, object],
    ) -> Counter[str]:
        """``router.write.units.join_unit`` for a call with rows of atomic targets:
        ``StagingError`` if one's unit would grow past its broker's atomic write; else the
        rows' tokens where the database needs them, and the rows added per target."""
        counts = {target: _count(count) for target, count in staged.items()}
        return join_unit(
            rows,
            self._stager.atomic_limits(database),
            unit,
            counts,
            tokens=dialect != "postgresql",
        )

    def targets_of(self, database: str, events: Sequence[Event]) -> set[str]:
        """The targets rows of these events go to."""
        return {r.target for e in events for r in self._stager.routes(database, type(e))}

    def _rows(
        self,
        database: str,
        events: Sequence[Event],
        stream_key: str | None,
        stream_keys: Sequence[str | None] | None,
        options: StageOptions,
    ) -> list[Row]:
        """The rows of one ``stage()`` call, with the context's correlation id and
        traceparent where the call gives none (``StagingError`` if any event cannot go)."""
        # Set only when there is one: options left empty skip build_rows' type check.
        correlation = options.get("correlation_id") or current_correlation_id()
        if correlation is not None:
            options["correlation_id"] = correlation
        traceparent = options.get("traceparent") or current_traceparent()
        if traceparent is not None:
            options["traceparent"] = traceparent
        return self._stager.build_rows(
            database, events, stream_key=stream_key, stream_keys=stream_keys, **options
        )

    def _key(self, database: str) -> str:
        key = self._keys.get(database)
        if key is None:
            key = self._keys[database] = database_key(
                self.config.databases[database], self.config.base_dir
            )
        return key

    def _database(self, database: str | None) -> str:
        if database is None:
            if len(self.config.databases) == 1:
                return next(iter(self.config.databases))
            raise StagingError(
                f"several databases are configured ({sorted(self.config.databases)}); "
                "pass database=..."
            )
        if database not in self.config.databases:
            raise StagingError(
                f"unknown database {database!r}; configured: {sorted(self.config.databases)}"
            )
        return database

    @staticmethod
    def _expect(name: str, configured: str, actual: str) -> None:
        if configured != actual:
            raise StagingError(
                f"database {name!r} is {configured} in the config, "
                f"but stage() got a {actual} connection"
            )


def _count(value: object) -> int:
    """A count the client kept, or one PostgreSQL gave (``count(*)``: an int on every driver)."""
    assert isinstance(value, int)
    return value


def message_ids(rows: Sequence[Row]) -> list[str]:
    """The staged events' ids, in order (an event has a row per target)."""
    if len(rows) == 1:  # one event for one target, the common call
        return [rows[0].message_id]
    return list(dict.fromkeys(row.message_id for row in rows))
