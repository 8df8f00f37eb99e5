"""Redis Streams adapter (FastStream's RedisBroker).

One ``XADD`` per message to the destination stream, in FastStream's message format (so
FastStream subscribers read it as they read their own), with the message id, type and
correlation id among its headers. Redis answers each XADD with the entry id once the entry
is in the stream.

A batch goes out in waves (no two messages of one stream key in a wave), each wave as one
pipeline: one round trip and one pooled connection for up to ``max_in_flight`` XADDs, which
Redis runs in order. A message that fails holds back the later messages of its stream. (One
connection per XADD in flight ran the client's pool dry under load.)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import redis.exceptions
from faststream.redis import RedisBroker as FastStreamRedis

from brokers._describe import describe
from brokers._faststream import FastStreamAdapter
from brokers._protocol import OutgoingMessage, PublishResult
from brokers.ordering import NOT_SENT, waves
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
_NO_ANSWER: tuple[type[BaseException], ...] = (*_UNAVAILABLE, TimeoutError)
_PING_FAILED: tuple[type[BaseException], ...] = (*_NO_ANSWER, redis.exceptions.RedisError)
# Error replies that pass: memory freed, a failover or a load finished, a slot moved.
_TRANSIENT: tuple[type[BaseException], ...] = (
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.AskError,
)
_TRANSIENT_PREFIXES = ("BUSY", "LOADING", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "OOM")


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
        await self._ping(broker)

    async def ping(self) -> None:
        """PING; a failure says why (refused, timed out, refused the password)."""
        broker = await self._connected()
        try:
            await self._ping(broker)
        except _PING_FAILED as exc:
            raise BrokerUnavailable(
                f"{self.name}: Redis does not answer: {self._reason(exc)}"
            ) from exc

    async def _ping(self, broker: Any) -> None:
        # FastStream's ping() turns every failure into False; the client's raises what it was.
        client = await broker.connect()  # the redis client; it connects on its first command
        await asyncio.wait_for(client.ping(), self.settings.connect_timeout)

    async def publish(self, batch: Sequence[OutgoingMessage]) -> list[PublishResult]:
        """XADD every message, a pipeline per wave; streams in order."""
        broker = await self._connected()
        client = await broker.connect()  # the connected redis client; no new connection
        results: list[PublishResult | None] = [None] * len(batch)
        held: set[str] = set()
        step = self.settings.max_in_flight
        for wave in waves(range(len(batch)), lambda i: batch[i].wire.stream_key):
            for start in range(0, len(wave), step):
                chunk = [i for i in wave[start : start + step] if not self._held(batch[i], held)]
                try:
                    await self._pipeline(broker, client, batch, chunk, results)
                except BrokerUnavailable as exc:
                    await self.close()
                    if not any(r is not None and r.ok for r in results):
                        raise
                    return _fill(results, PublishResult.failed(str(exc), retryable=True))
                for i in chunk:
                    result, key = results[i], batch[i].wire.stream_key
                    if result is not None and not result.ok and result.retryable and key:
                        held.add(key)
        return _fill(results, PublishResult.failed(NOT_SENT, retryable=True))

    @staticmethod
    def _held(message: OutgoingMessage, held: set[str]) -> bool:
        return message.wire.stream_key is not None and message.wire.stream_key in held

    async def _pipeline(
        self,
        broker: Any,
        client: Any,
        batch: Sequence[OutgoingMessage],
        chunk: list[int],
        results: list[PublishResult | None],
    ) -> None:
        if not chunk:
            return
        pipe = client.pipeline(transaction=False)
        for i in chunk:
            wire = batch[i].wire
            await broker.publish(
                wire.body,
                stream=batch[i].destination,
                maxlen=self.settings.maxlen,
                headers=dict(wire.headers),
                correlation_id=wire.correlation_id or wire.message_id,
                pipeline=pipe,
            )
        try:
            replies = await asyncio.wait_for(
                pipe.execute(raise_on_error=False), self.settings.publish_timeout
            )
        except _NO_ANSWER as exc:
            raise BrokerUnavailable(f"{self.name}: Redis unreachable: {describe(exc)}") from exc
        for i, reply in zip(chunk, replies, strict=True):
            results[i] = _classify(reply) if isinstance(reply, Exception) else PublishResult.acked()


def _fill(results: list[PublishResult | None], missing: PublishResult) -> list[PublishResult]:
    return [r if r is not None else missing for r in results]


def _classify(exc: Exception) -> PublishResult:
    if isinstance(exc, _UNAVAILABLE):
        return PublishResult.failed(f"Redis unreachable: {describe(exc)}", retryable=True)
    if isinstance(exc, _TRANSIENT) or str(exc).startswith(_TRANSIENT_PREFIXES):
        return PublishResult.failed(f"Redis is busy: {describe(exc)}", retryable=True)
    if isinstance(exc, redis.exceptions.ResponseError):
        return PublishResult.failed(f"rejected by Redis: {describe(exc)}", retryable=False)
    if isinstance(exc, redis.exceptions.AuthenticationError):
        return PublishResult.failed(f"authentication refused: {describe(exc)}", retryable=False)
    return PublishResult.failed(f"Redis error: {describe(exc)}", retryable=True)
