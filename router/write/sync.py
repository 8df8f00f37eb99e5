"""``SyncOutbox``: ``Outbox``'s twin for sync code (Flask, Django, scripts, Celery workers).

    outbox = SyncOutbox.from_file("config.yaml")

    with Session(engine) as session, session.begin():
        session.add(order)
        outbox.stage(session, OrderPlaced(order_id=order.id), stream_key=order.id)

The same rows, checks, errors and per-stream commit order as ``await Outbox.stage(...)``:
both build them with one ``Stager``; only running the statements differs
(``router.write.drivers``). No event loop is started and no asyncio driver is imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Unpack

from envelopes import StageOptions
from router.write.drivers import sync_driver
from router.write.events import Event
from router.write.writer import Writer, message_ids

__all__ = ["SyncOutbox"]


class SyncOutbox(Writer):
    """Stages events as outbox rows, one per target, in the caller's (sync) transaction."""

    def stage(
        self,
        connection: Any,
        *events: Event,
        database: str | None = None,
        stream_key: str | None = None,
        stream_keys: Sequence[str | None] | None = None,
        **options: Unpack[StageOptions],
    ) -> list[str]:
        """Write ``events`` to the outbox in ``connection``'s transaction; returns their ids.

        ``connection``: a SQLAlchemy ``Session`` or ``Connection``, Django's connection
        inside ``transaction.atomic()``, or a psycopg, psycopg2 or sqlite3 connection. The
        keywords and the ``StagingError`` cases are ``Outbox.stage``'s; nothing is written
        when it raises.
        """
        if not events and not stream_keys:  # keys without events: build_rows says why
            return []
        name = self._database(database)
        rows = self._rows(name, events, stream_key, stream_keys, options)
        driver = sync_driver(connection)
        self._expect(name, self.config.databases[name].kind, driver.dialect)
        for statement in self._stager.statements(driver.dialect, rows):
            driver.execute(statement)
        return message_ids(rows)
