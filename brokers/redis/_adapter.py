"""Redis Streams adapter (FastStream's RedisBroker).

One ``XADD`` per message to the destination stream, in FastStream's message format (so
FastStream subscribers read it as they read their own), with the message id, type and
correlation id among its headers. Redis answers each XADD with the entry id once the entry
is in the stream.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import redis.exceptions
from faststream.redis import RedisBroker as FastStreamRedis

from brokers._describe import describe
from brokers._faststream import FastStreamAdapter
from brokers._ordered import publish_in_order
from brokers._protocol import OutgoingMessage, PublishResult
from brokers.redis._settings import RedisSettings
from envelopes import BrokerUnavailable

__all__ = ["RedisBroker"]

log = logging.getLogger(__name__)

_UNAVAILABLE: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    ConnectionError,
    OSError,
)


class RedisBroker(FastStreamAdapter):
    """Appends to Redis streams; see ``brokers._protocol`` for the contract."""

    kind = "Redis"
    settings: RedisSettings

    def __init__(self, name: str, settings: RedisSettings) -> None:
        super().__init__(name, settings)

    def _make(self) -> Any:
        options: dict[str, Any] = {
            "socket_timeout": self.settings.publish_timeout,
            "socket_connect_timeout": self.settings.connect_timeout,
            "logger": None,  # library code logs through its own loggers only
        }
        return FastStreamRedis(self.settings.url.get_secret_value(), **options)

    async def _prepare(self, broker: Any) -> None:
        if not await broker.ping(timeout=self.settings.connect_timeout):
            raise BrokerUnavailable("no answer to PING")

    async def publish(self, batch: Sequence[OutgoingMessage]) -> list[PublishResult]:
        """XADD every message; streams in order."""
        broker = await self._connected()
        maxlen = self.settings.maxlen

        async def send(message: OutgoingMessage) -> None:
            wire = message.wire
            try:
                await broker.publish(
                    wire.body,
                    stream=message.destination,
                    maxlen=maxlen,
                    headers=dict(wire.headers),
                    correlation_id=wire.correlation_id or wire.message_id,
                )
            except _UNAVAILABLE as exc:
                raise BrokerUnavailable(f"{self.name}: Redis unreachable: {describe(exc)}") from exc

        results = await publish_in_order(
            batch, send, _classify, concurrency=self.settings.max_in_flight
        )
        if any(not r.ok and r.retryable for r in results):
            await self.close()
        return results


def _classify(exc: Exception) -> PublishResult:
    if isinstance(exc, redis.exceptions.ResponseError):
        return PublishResult.failed(f"rejected by Redis: {describe(exc)}", retryable=False)
    if isinstance(exc, redis.exceptions.AuthenticationError):
        return PublishResult.failed(f"authentication refused: {describe(exc)}", retryable=False)
    return PublishResult.failed(f"Redis error: {describe(exc)}", retryable=True)
