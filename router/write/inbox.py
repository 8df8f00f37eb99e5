"""The consumer side: apply each event's effect once, however often it is delivered.

Delivery is at least once, so a consumer sees a duplicate sooner or later. Record the
message id in the same transaction as the effect; a second delivery finds the record and
skips::

    inbox = Inbox("billing")

    async with engine.begin() as conn:
        if await inbox.first_time(conn, message_id_of(body, headers)):
            await conn.execute(...)          # the effect, in the same transaction

If the effect fails, the transaction rolls back with the record, and the redelivery is
applied. Two deliveries of one message at once (two consumer instances): the primary key
makes the second wait for the first's transaction, then skip. Records older than
``outbox.retention.inbox`` are removed by ``router cleanup``; a duplicate that arrives after
that window is applied again.

For FastStream subscribers, ``inbox_middleware`` does this around the handler, which finds
the transaction's connection in FastStream's context.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

from envelopes import RouterError, message_id_of
from router._db import sqlite_time
from router._schema import INBOX

__all__ = ["Inbox", "inbox_middleware", "message_id_of"]

log = logging.getLogger(__name__)

_INSERT = {
    "postgresql": text(
        f"INSERT INTO {INBOX} (consumer, message_id) VALUES (:consumer, :message_id) "
        "ON CONFLICT (consumer, message_id) DO NOTHING"
    ),
    "sqlite": text(
        f"INSERT INTO {INBOX} (consumer, message_id, received_at) "
        "VALUES (:consumer, :message_id, :now) ON CONFLICT (consumer, message_id) DO NOTHING"
    ),
    # MySQL has no DO NOTHING, and its rowcount cannot tell a duplicate left as it was from a
    # new record: both count 1, as SQLAlchemy's MySQL dialects always set CLIENT_FOUND_ROWS.
    # So a duplicate changes its record, by a microsecond (the record still dates from the
    # first delivery), and counts 2. (INSERT IGNORE would also cut a too long message id
    # down to the column's 255 characters, and take two messages for one.)
    "mysql": text(
        f"INSERT INTO {INBOX} (consumer, message_id) VALUES (:consumer, :message_id) "
        "ON DUPLICATE KEY UPDATE received_at = received_at + INTERVAL 1 MICROSECOND"
    ),
}


class Inbox:
    """The dedup records of one consumer (a name per logical subscriber)."""

    def __init__(self, consumer: str) -> None:
        if not consumer:
            raise ValueError("an inbox needs a consumer name")
        self.consumer = consumer

    async def first_time(
        self, connection: AsyncConnection | AsyncSession, message_id: str | None
    ) -> bool:
        """Record ``message_id`` in the caller's transaction; False if it was applied before.

        Raises ``RouterError`` when the message carries no id (nothing to deduplicate on).
        """
        if not message_id:
            raise RouterError("the message carries no message id; it cannot be deduplicated")
        conn = await connection.connection() if isinstance(connection, AsyncSession) else connection
        insert = _INSERT.get(conn.dialect.name)
        if insert is None:
            raise RouterError(
                f"the inbox runs on PostgreSQL, SQLite and MySQL/MariaDB, not {conn.dialect.name}"
            )
        result = await conn.execute(
            insert,
            {
                "consumer": self.consumer,
                "message_id": message_id,
                "now": sqlite_time(datetime.now(UTC)),
            },
        )
        fresh = result.rowcount == 1  # a duplicate: 0, or 2 on MySQL
        if not fresh:
            log.info(
                "inbox.duplicate_skipped",
                extra={"consumer": self.consumer, "message_id": message_id},
            )
        return fresh

    async def handle(
        self,
        engine: AsyncEngine,
        message_id: str | None,
        effect: Callable[[AsyncConnection], Awaitable[Any]],
    ) -> bool:
        """Run ``effect`` in a transaction with the record, unless it was applied before.

        Returns True when the effect ran (and committed), False for a duplicate.
        """
        async with engine.begin() as conn:
            if not await self.first_time(conn, message_id):
                return False
            await effect(conn)
        return True


def inbox_middleware(inbox: Inbox, engine: AsyncEngine, *, context_key: str = "inbox") -> Any:
    """A FastStream middleware applying ``inbox`` around every handler of a subscriber.

    The handler runs inside the transaction holding the record; it gets the connection with
    ``conn: AsyncConnection = Context("inbox")`` and does its writes there. A duplicate is
    acknowledged without calling the handler.
    """
    from faststream import BaseMiddleware

    class InboxMiddleware(BaseMiddleware):
        async def consume_scope(self, call_next: Callable[[Any], Awaitable[Any]], msg: Any) -> Any:
            message_id = message_id_of(
                msg.body, msg.headers, native_id=getattr(msg, "message_id", None)
            )
            async with engine.begin() as conn:
                if not await inbox.first_time(conn, message_id):
                    return None
                with self.context.scope(context_key, conn):
                    return await call_next(msg)

    return InboxMiddleware
