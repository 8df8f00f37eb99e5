"""The chaos run's consumer: a FastStream JetStream subscriber behind the inbox.

Every delivery is counted; the effect (a row in ``chaos_effects``, which has no unique key
of its own) is written in the inbox's transaction. Duplicate deliveries must leave exactly
one effect per event.
"""

from __future__ import annotations

import asyncio
from typing import Any

from faststream import AckPolicy, Context
from faststream.nats import JStream, NatsBroker, PullSub
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from router.write.inbox import Inbox, inbox_middleware

__all__ = ["InboxConsumer"]


class InboxConsumer:
    """Consumes the chaos stream durably; effects go to PostgreSQL through the inbox."""

    def __init__(self, nats_url: str, dsn: str, stream: str, subject: str) -> None:
        self.nats_url = nats_url
        self.dsn = dsn.replace("postgresql://", "postgresql+asyncpg://", 1)
        self.stream = stream
        self.subject = subject
        self.deliveries = 0
        self.engine: AsyncEngine | None = None
        self.broker: NatsBroker | None = None

    async def start(self) -> None:
        """Create the effects table and start consuming."""
        self.engine = create_async_engine(self.dsn, pool_pre_ping=True)
        async with self.engine.begin() as conn:
            await conn.execute(
                text(
                    "CREATE TABLE IF NOT EXISTS chaos_effects (message_id text, stream text, n int)"
                )
            )
        consumer = self
        deduplicating = inbox_middleware(Inbox("chaos"), self.engine)

        class Counting(deduplicating):  # type: ignore[misc, valid-type]
            """Counts every delivery before the inbox decides what to do with it."""

            async def consume_scope(self, call_next: Any, msg: Any) -> Any:
                consumer.deliveries += 1
                return await super().consume_scope(call_next, msg)

        self.broker = NatsBroker(
            self.nats_url,
            logger=None,
            max_reconnect_attempts=-1,
            reconnect_time_wait=1,
            middlewares=[Counting],
        )

        @self.broker.subscriber(
            self.subject,
            stream=JStream(self.stream, declare=False),
            durable="chaos-inbox",
            pull_sub=PullSub(batch_size=100, timeout=1),
            ack_policy=AckPolicy.NACK_ON_ERROR,
        )
        async def on_tick(
            body: dict[str, Any],
            conn: AsyncConnection = Context("inbox"),  # noqa: B008 - FastStream's injection
        ) -> None:
            tick = body["payload"]
            await conn.execute(
                text("INSERT INTO chaos_effects VALUES (:m, :s, :n)"),
                {"m": body["id"], "s": tick["stream"], "n": tick["n"]},
            )

        await self.broker.start()

    async def effects(self) -> tuple[int, int]:
        """(distinct events with an effect, events with more than one effect)."""
        assert self.engine is not None
        for _ in range(50):
            try:
                async with self.engine.connect() as conn:
                    row = (
                        await conn.execute(
                            text(
                                "SELECT count(DISTINCT message_id), "
                                "(SELECT count(*) FROM (SELECT message_id FROM chaos_effects "
                                " GROUP BY message_id HAVING count(*) > 1) AS d) FROM chaos_effects"
                            )
                        )
                    ).one()
                return int(row[0]), int(row[1])
            except Exception:  # the database may be restarting
                await asyncio.sleep(0.2)
        raise RuntimeError("the database did not answer")

    async def stop(self) -> None:
        """Stop consuming."""
        if self.broker is not None:
            await self.broker.stop()
        if self.engine is not None:
            await self.engine.dispose()
