"""What the async ``Outbox`` and the sync ``SyncOutbox`` share: everything but running the
statements. Rows are built and checked here, once (``Stager``: pure, no I/O), as httpx's
``Client`` and ``AsyncClient`` share one base; only the insert differs between the two."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Self

from envelopes import StageOptions, StagingError
from router._local import database_key
from router._yaml import load_config
from router.config import RouterConfig
from router.write._tracing import current_traceparent
from router.write.events import Event, current_correlation_id
from router.write.staging import Row, Stager

__all__ = ["Writer", "message_ids"]


class Writer:
    """The config, the row builder, and the checks of a ``stage()`` call before any I/O."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._stager = Stager(config)
        self._keys: dict[str, str] = {}

    @classmethod
    def from_file(cls, path: str | os.PathLike[str] | None = None) -> Self:
        """Load ``config.yaml`` (or ``$ROUTER_CONFIG``) and build an outbox from it."""
        return cls(load_config(path or os.environ.get("ROUTER_CONFIG", "config.yaml")))

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
        options["correlation_id"] = options.get("correlation_id") or current_correlation_id()
        options["traceparent"] = options.get("traceparent") or current_traceparent()
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


def message_ids(rows: Sequence[Row]) -> list[str]:
    """The staged events' ids, in order (an event has a row per target)."""
    return list(dict.fromkeys(row.message_id for row in rows))
