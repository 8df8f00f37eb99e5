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
from router.write.events import Event
from router.write.writer import Writer

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
        return self._stage_sync(
            connection,
            events,
            database=database,
            stream_key=stream_key,
            stream_keys=stream_keys,
            options=options,
        )
