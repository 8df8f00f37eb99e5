"""The connection lifecycle shared by the adapters that drive a FastStream broker (Kafka,
RabbitMQ): connect within the timeout, prepare (declare, check), ping, close. (Redis Streams
writes plain entries with redis-py; FastStream only frames its ``format: faststream``.)"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, ClassVar

from brokers._describe import unreachable
from brokers._settings import BrokerSettings
from envelopes import BrokerError, BrokerUnavailable

__all__ = ["FastStreamAdapter"]

log = logging.getLogger(__name__)


class FastStreamAdapter:
    """Subclasses build the FastStream broker (``_make``) and may ``_prepare`` it."""

    kind: ClassVar[str] = ""  # how messages name the broker: "Kafka", "RabbitMQ", "Redis"

    def __init__(self, name: str, settings: BrokerSettings) -> None:
        self.name = name
        self.settings = settings
        self._broker: Any = None
        # Two batches may publish at once: one connect, which the other waits for.
        self._connecting = asyncio.Lock()

    def _make(self) -> Any:
        """A new, unconnected FastStream broker."""
        raise NotImplementedError

    async def _prepare(self, broker: Any) -> None:
        """Anything to do once connected (declare an exchange, check an answer)."""

    def _connect_error(self, exc: BaseException) -> BrokerError:
        return BrokerUnavailable(
            f"{self.name}: cannot connect to {self.kind}: {unreachable(exc, self.settings)}"
        )

    async def connect(self) -> None:
        """Connect and prepare, within connect_timeout."""
        if self._broker is not None:
            return
        async with self._connecting:
            if self._broker is None:
                await self._connect()

    async def _connect(self) -> None:
        broker = self._make()
        limit = self.settings.connect_timeout + 1
        try:
            await asyncio.wait_for(broker.connect(), limit)
            await asyncio.wait_for(self._prepare(broker), limit)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                await broker.stop()
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise self._connect_error(exc) from exc
        self._broker = broker
        log.info("broker.connected", extra={"broker": self.name, "kind": self.kind})

    async def _connected(self) -> Any:
        await self.connect()
        return self._broker

    async def ping(self) -> None:
        """Ask the broker for an answer."""
        broker = await self._connected()
        if not await broker.ping(timeout=self.settings.connect_timeout):
            raise BrokerUnavailable(f"{self.name}: {self.kind} does not answer")

    async def close(self) -> None:
        """Close the connection; safe to call more than once."""
        broker, self._broker = self._broker, None
        if broker is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(broker.stop(), 10)
