"""RabbitMQ adapter (FastStream's RabbitBroker over aio-pika).

Messages are persistent and published ``mandatory`` on a channel with publisher confirms and
``on_return_raises``: ``publish`` returns only once the broker confirmed the message, and a
message no queue would receive is a retryable error rather than lost (the partner may bind
its queue later). ``message_id`` and
``correlation_id`` are AMQP properties; the type goes in ``type``.

Each message is built here, as an aio-pika ``Message`` with exactly
``RabbitSettings.native_properties`` and the rendered headers, and FastStream sends it as it
is: left to itself, FastStream adds ``app_id`` (its own name and version), a random
``correlation_id``, the publish time as ``timestamp`` and ``priority`` 0, so a replay of a
stored row would not be the message first sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import aio_pika
import aio_pika.abc
import aio_pika.exceptions
import aiormq.exceptions
from faststream.rabbit import Channel, ExchangeType, RabbitExchange
from faststream.rabbit import RabbitBroker as FastStreamRabbit

from brokers._describe import describe
from brokers._faststream import FastStreamAdapter
from brokers._protocol import OutgoingMessage, PublishResult
from brokers.ordering import publish_in_order
from brokers.rabbitmq._settings import RabbitSettings
from envelopes import BrokerError, BrokerUnavailable, MissingDestination, WireMessage

__all__ = ["RabbitBroker"]

log = logging.getLogger(__name__)

# Seconds between AMQP heartbeats, unless the URL sets its own (?heartbeat=N).
_HEARTBEAT = 10
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    aiormq.exceptions.AMQPConnectionError,
    aiormq.exceptions.ChannelInvalidStateError,
    aio_pika.exceptions.ChannelClosed,
    ConnectionError,
    OSError,
)
_NO_ANSWER: tuple[type[BaseException], ...] = (TimeoutError, *_UNAVAILABLE)


class RabbitBroker(FastStreamAdapter):
    """Publishes to one exchange; see ``brokers._protocol`` for the contract."""

    kind = "RabbitMQ"
    settings: RabbitSettings

    def __init__(self, name: str, settings: RabbitSettings) -> None:
        super().__init__(name, settings)
        self._amqp: _ClosedOnFailedConnect | None = None
        self._exchange = RabbitExchange(
            settings.exchange.name,
            type=ExchangeType(settings.exchange.type),
            durable=settings.exchange.durable,
            declare=settings.exchange.declare,
        )

    def _make(self) -> Any:
        broker = FastStreamRabbit(
            self.settings.url.get_secret_value(),
            default_channel=Channel(publisher_confirms=True, on_return_raises=True),
            timeout=self.settings.connect_timeout,
            fail_fast=True,
            logger=None,
            app_id=None,
        )
        # FastStream has no parameter for it; its connect passes these keywords on to
        # aio_pika.connect_robust, which takes connection_class. Should a FastStream version
        # keep them elsewhere, tests/e2e/test_shutdown.py's hanging connect fails.
        kwargs = getattr(broker, "_connection_kwargs", None)
        if isinstance(kwargs, dict):
            kwargs["connection_class"] = self._connection
            # aio-pika's default heartbeat is the server's (60 s): a connection to a broker
            # that went silent while idle is found within about two heartbeats instead.
            if "heartbeat" not in urlsplit(self.settings.url.get_secret_value()).query:
                kwargs["heartbeat"] = _HEARTBEAT
        return broker

    def _connection(self, *args: Any, **kwargs: Any) -> _ClosedOnFailedConnect:
        """aio-pika's connection class, as a factory that keeps the connection for ping()."""
        self._amqp = _ClosedOnFailedConnect(*args, **kwargs)
        return self._amqp

    async def ping(self) -> None:
        """A round trip on the connection: a channel opened and closed. (FastStream's ping
        only reads the connection's flag, which stays up on a connection gone silent.)"""
        await self._connected()
        connection = self._amqp
        if connection is None:
            raise BrokerUnavailable(f"{self.name}: RabbitMQ does not answer")
        try:
            async with asyncio.timeout(self.settings.connect_timeout):
                channel = await connection.channel(publisher_confirms=False)
                await channel.close()
        except _NO_ANSWER as exc:
            raise BrokerUnavailable(
                f"{self.name}: RabbitMQ does not answer: {describe(exc)}"
            ) from exc

    async def _prepare(self, broker: Any) -> None:
        await broker.declare_exchange(self._exchange)

    def _connect_error(self, exc: BaseException) -> BrokerError:
        if isinstance(exc, aiormq.exceptions.ChannelNotFoundEntity):
            return MissingDestination(
                f"{self.name}: exchange {self.settings.exchange.name!r} does not exist "
                "(and exchange.declare is off)"
            )
        return super()._connect_error(exc)

    async def publish(self, batch: Sequence[OutgoingMessage]) -> list[PublishResult]:
        """Publish every message and wait for its confirm; streams in order."""
        broker = await self._connected()
        settings = self.settings

        async def send(message: OutgoingMessage) -> str:
            try:
                await broker.publish(
                    _amqp_message(settings, message.wire),
                    exchange=self._exchange,
                    routing_key=message.destination,
                    mandatory=settings.mandatory,
                    timeout=settings.publish_timeout,
                )
            except _UNAVAILABLE as exc:
                raise BrokerUnavailable(
                    f"{self.name}: RabbitMQ unreachable: {describe(exc)}"
                ) from exc
            # AMQP confirms carry no position (a delivery tag is per channel and reused):
            # the receipt is when the broker confirmed the message.
            return _confirmed_at()

        results = await publish_in_order(batch, send, _classify, concurrency=settings.max_in_flight)
        if any(_closes_channel(r) for r in results):
            await self.close()  # the channel is gone; the next batch opens a fresh one
        return results


class _ClosedOnFailedConnect(aio_pika.RobustConnection):
    """A robust connection that closes itself when its first connect does not complete.

    aio-pika's reconnect loop is a task of its own, started by ``connect()``, that survives a
    cancelled connect: it logs "cancelled, reconnecting" and tries again every
    ``reconnect_interval``, and swallows the cancellation ``asyncio.run`` sends at exit, so a
    SIGTERM during a connect to an endpoint that never answers left ``router serve`` running
    (after "router.stopped") for good. Nothing else holds the half-made connection: FastStream
    only keeps one that connected. Once connected, it reconnects as any robust connection.
    """

    async def connect(self, timeout: aio_pika.abc.TimeoutType = None) -> None:
        try:
            await super().connect(timeout)
        except BaseException:
            # Stops the reconnect loop, whose cancellation it then lets through.
            with contextlib.suppress(Exception):
                await self.close()
            raise


def _amqp_message(settings: RabbitSettings, wire: WireMessage) -> aio_pika.Message:
    """The message with the rendered headers and exactly the settings' native properties."""
    properties: dict[str, Any] = settings.native_properties(wire)  # each of its own type
    headers: dict[str, Any] = settings.native_headers(wire)
    message = aio_pika.Message(wire.body, headers=headers, **properties)
    if "priority" not in properties:
        message.priority = None  # aio-pika's default is 0: absent unless staged
    return message


def _confirmed_at() -> str:
    at = datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")
    return f'{{"confirmed_at":"{at}"}}'


def _classify(exc: Exception) -> PublishResult:
    if isinstance(exc, aiormq.exceptions.PublishError):  # returned: mandatory and unroutable
        return _unroutable(exc)
    if isinstance(exc, aio_pika.exceptions.DeliveryError):
        return PublishResult.failed(f"RabbitMQ refused it (nack): {describe(exc)}", retryable=True)
    if isinstance(exc, aiormq.exceptions.ChannelNotFoundEntity):
        return PublishResult.failed(f"entity missing: {describe(exc)}", retryable=False)
    if isinstance(exc, aiormq.exceptions.ChannelAccessRefused):
        return PublishResult.failed(f"access refused: {describe(exc)}", retryable=False)
    if isinstance(exc, TimeoutError):
        return PublishResult.cut_off("no confirm within publish_timeout")
    return PublishResult.failed(f"RabbitMQ error: {describe(exc)}", retryable=True)


def _unroutable(exc: aiormq.exceptions.PublishError) -> PublishResult:
    """A message RabbitMQ returned because no queue would take it: retryable.

    No verdict on the message: the route is the partner's to make, and a partner that binds
    its queue once its consumer first starts would otherwise see its first events abandoned
    and need a ``router requeue``. Retried with backoff, it is delivered once the queue is
    bound, and abandoned after ``max_attempts`` as any retryable failure.
    """
    delivery: Any = getattr(exc.message, "delivery", None)
    reason = getattr(delivery, "reply_text", "NO_ROUTE")
    exchange = getattr(delivery, "exchange", "?")
    routing_key = getattr(delivery, "routing_key", "?")
    return PublishResult.failed(
        f"unroutable: no queue bound to exchange {exchange!r} with routing key "
        f"{routing_key!r} ({reason}); bind one (the partner's queue), or change the "
        "destination; retried until max_attempts",
        retryable=True,
    )


def _closes_channel(result: PublishResult) -> bool:
    return not result.ok and (result.error or "").startswith(("entity missing", "access refused"))
