"""An in-memory broker for unit tests of the processor (never a stand-in for a broker test).

Like httpx's mock transport, it takes a plain function that decides each message's fate::

    broker = MemoryBroker("partner", handler=lambda m: PublishResult.failed("no", retryable=False))

``down = True`` makes it behave like an unreachable broker; ``hang = True`` like one that
accepts the connection and never answers. ``wait_for(n)`` lets a test wait for deliveries.

It is an ``AtomicBroker``: ``publish_atomic`` asks the same handler about every member of a
unit, and stores the unit whole (in ``messages``, and as one entry of ``units``) only when it
refused none; a member it refuses (or cuts off) is the verdict on the whole unit, as
``unit_verdict`` words it. A unit of more than ``max_unit`` messages is refused unsent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import ClassVar, Literal

from pydantic import Field

from brokers._protocol import OutgoingMessage, PublishResult, unit_too_large, unit_verdict
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
    no_atomic_unit: ClassVar[str | None] = None
    atomic_unit: ClassVar[str | None] = "one unit of the in-memory broker"
    max_unit: ClassVar[int | None] = 1000  # MemoryBroker.max_unit


class MemoryBroker:
    """Keeps every acknowledged message in ``messages``, in publish order."""

    max_unit = 1000
    """The most messages one atomic unit may hold (as JetStream's batch); a test may lower it."""

    def __init__(self, name: str = "memory", *, handler: Handler | None = None) -> None:
        self.name = name
        self.handler = handler
        self.messages: list[OutgoingMessage] = []
        self.units: list[list[OutgoingMessage]] = []
        """The atomic units stored, in publish order (their messages are in ``messages`` too)."""
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
            result = self._judge(message)
            if result.ok:
                self.messages.append(message)
            results.append(result)
        await self._notify()
        return results

    async def publish_atomic(
        self, units: Sequence[Sequence[OutgoingMessage]]
    ) -> list[list[PublishResult]]:
        """Store each unit whole when the handler refuses none of its members; else store none
        of it, every member with the one verdict (``brokers._protocol.AtomicBroker``)."""
        await self._reachable()
        verdicts = []
        for unit in units:
            refused = unit_too_large(unit, self.max_unit, "memory broker's unit")
            if refused is not None:
                verdicts.append(refused)
                continue
            members = [self._judge(message) for message in unit]
            verdict = unit_verdict(members, [m.wire.message_id for m in unit])
            if all(r.ok for r in verdict):
                self.messages.extend(unit)
                self.units.append(list(unit))
            verdicts.append(verdict)
        await self._notify()
        return verdicts

    def _judge(self, message: OutgoingMessage) -> PublishResult:
        """What the handler makes of one message (acknowledged when it says nothing)."""
        self.attempts.append(message)
        result = self.handler(message) if self.handler else None
        return PublishResult.acked() if result is None or result.ok else result

    async def _notify(self) -> None:
        async with self._arrived:
            self._arrived.notify_all()

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
