"""An in-memory broker for unit tests of the processor (never a stand-in for a broker test).

Like httpx's mock transport, it takes a plain function that decides each message's fate::

    broker = MemoryBroker("partner", handler=lambda m: PublishResult.failed("no", retryable=False))

``down = True`` makes it behave like an unreachable broker; ``hang = True`` like one that
accepts the connection and never answers. ``wait_for(n)`` lets a test wait for deliveries.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Literal

from pydantic import Field

from brokers._protocol import OutgoingMessage, PublishResult
from brokers._settings import BrokerSettings
from envelopes import BrokerUnavailable

__all__ = ["MemoryBroker", "MemorySettings"]

Handler = Callable[[OutgoingMessage], PublishResult | None]


class MemorySettings(BrokerSettings):
    """Settings of the in-memory broker (``type: memory``); for tests only."""

    type: Literal["memory"] = Field(
        description="The in-memory broker, for tests only: it keeps messages in the process "
        "and delivers them nowhere. Never a broker to deploy."
    )


class MemoryBroker:
    """Keeps every acknowledged message in ``messages``, in publish order."""

    def __init__(self, name: str = "memory", *, handler: Handler | None = None) -> None:
        self.name = name
        self.handler = handler
        self.messages: list[OutgoingMessage] = []
        self.attempts: list[OutgoingMessage] = []
        self.down = False
        self.hang = False
        self.connected = False
        self._arrived = asyncio.Condition()

    async def connect(self) -> None:
        """Connect, unless the broker is marked down."""
        await self._reachable()
        self.connected = True

    async def publish(self, batch: Sequence[OutgoingMessage]) -> list[PublishResult]:
        """Record each message the handler lets through; the rest fail as it says."""
        await self._reachable()
        results = []
        for message in batch:
            self.attempts.append(message)
            result = self.handler(message) if self.handler else None
            if result is None or result.ok:
                self.messages.append(message)
                results.append(PublishResult.acked())
            else:
                results.append(result)
        async with self._arrived:
            self._arrived.notify_all()
        return results

    async def ping(self) -> None:
        """Answer unless down or hanging."""
        await self._reachable()

    async def close(self) -> None:
        """Forget the connection."""
        self.connected = False

    async def wait_for(self, count: int, timeout: float = 5.0) -> list[OutgoingMessage]:
        """Wait until at least ``count`` messages were acknowledged; return them all."""
        async with asyncio.timeout(timeout), self._arrived:
            await self._arrived.wait_for(lambda: len(self.messages) >= count)
        return list(self.messages)

    def ids(self) -> list[str]:
        """Message ids acknowledged so far, in order."""
        return [m.wire.message_id for m in self.messages]

    async def _reachable(self) -> None:
        if self.hang:
            await asyncio.Event().wait()
        if self.down:
            raise BrokerUnavailable(f"{self.name}: broker is down")
