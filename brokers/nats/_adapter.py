"""NATS JetStream adapter.

FastStream's ``NatsBroker`` owns the connection (servers, reconnects, TLS, auth). Publishing
goes through that connection's JetStream context with ``publish_async``: every message of a
batch is written at once and their PubAcks are awaited together, which is about twice as
cheap per message as awaiting FastStream's ``publish`` one by one. Messages leave in batch
order on one connection, so JetStream stores them in that order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import nats.errors
import nats.js.errors
from faststream.nats import NatsBroker as FastStreamNats
from nats.js.api import StorageType, StreamConfig

from brokers._protocol import OutgoingMessage, PublishResult
from brokers.nats._settings import NatsSettings, subject_matches
from envelopes import BrokerError, BrokerUnavailable

__all__ = ["NatsBroker"]

log = logging.getLogger(__name__)

MSG_ID_HEADER = "Nats-Msg-Id"

# Failures that mean "the connection is not usable": nothing in the batch counts as sent.
_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.ConnectionDrainingError,
    nats.errors.NoServersError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.UnexpectedEOF,
    ConnectionError,
    OSError,
)
_ANSWER_ERRORS: tuple[type[BaseException], ...] = (
    TimeoutError,
    nats.errors.Error,
    *_CONNECTION_ERRORS,
)


class NatsBroker:
    """Publishes to one JetStream stream; see ``brokers._protocol`` for the contract."""

    def __init__(self, name: str, settings: NatsSettings) -> None:
        self.name = name
        self.settings = settings
        self._broker: FastStreamNats | None = None
        self._js: Any = None

    async def connect(self) -> None:
        """Connect and create (or check) the stream."""
        if self._broker is not None:
            return
        errors: list[BaseException] = []

        async def remember(error: BaseException) -> None:
            errors.append(error)

        # A few quick reconnects ride out a server restart; past them the connection closes,
        # publish reports BrokerUnavailable and the processor reconnects on its own schedule.
        # Few attempts also make an unreachable server fail fast, with its real reason.
        options: dict[str, Any] = {
            "connect_timeout": max(1, round(self.settings.connect_timeout)),
            "allow_reconnect": True,
            "max_reconnect_attempts": 2,
            "reconnect_time_wait": 0.25,  # nats-py takes seconds as float; FastStream says int
            "error_cb": remember,
            "name": f"outbox-router:{self.name}",
            "logger": None,
        }
        broker = FastStreamNats(self.settings.servers(), **options)
        try:
            await asyncio.wait_for(broker.connect(), self.settings.connect_timeout + 1)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                await broker.stop()
            if isinstance(exc, asyncio.CancelledError):
                raise
            reason = _describe(errors[-1]) if errors else _describe(exc)
            raise BrokerUnavailable(f"{self.name}: cannot connect to NATS: {reason}") from exc
        self._broker = broker
        log.info("nats.connected", extra={"broker": self.name})
        self._js = broker.connection.jetstream(
            timeout=self.settings.publish_timeout,
            publish_async_max_pending=self.settings.max_in_flight,
        )
        try:
            await self._ensure_stream()
        except BaseException:
            await self.close()
            raise

    async def publish(self, batch: Sequence[OutgoingMessage]) -> list[PublishResult]:
        """Publish all messages with acks in flight; one result per message, in order."""
        if self._broker is None:
            await self.connect()
        js = self._js
        stream = self.settings.stream.name
        futures: list[asyncio.Future[Any]] = []
        try:
            for message in batch:
                headers = dict(message.wire.headers)
                headers[MSG_ID_HEADER] = message.wire.message_id
                futures.append(
                    await js.publish_async(
                        message.destination,
                        message.wire.body,
                        # No wait_stall: a timeout there costs a task per message (half
                        # the throughput); the processor bounds the whole call instead.
                        wait_stall=None,
                        stream=stream,
                        headers=headers,
                    )
                )
        except _CONNECTION_ERRORS as exc:
            _cancel(futures)
            raise BrokerUnavailable(f"{self.name}: NATS connection lost: {_describe(exc)}") from exc
        except nats.errors.MaxPayloadError as exc:
            # One message over the server's max_payload: the ones before it are in flight.
            return (
                await self._collect(futures)
                + [PublishResult.failed(f"message too large: {_describe(exc)}", retryable=False)]
                + [
                    PublishResult.failed(
                        "not sent: an earlier message was too large", retryable=True
                    )
                    for _ in batch[len(futures) + 1 :]
                ]
            )
        except nats.js.errors.TooManyStalledMsgsError:
            return await self._collect(futures) + [
                PublishResult.failed("too many publishes awaiting acks", retryable=True)
                for _ in batch[len(futures) :]
            ]
        return await self._collect(futures)

    async def ping(self) -> None:
        """Round-trip to the server (and JetStream account info)."""
        if self._broker is None:
            await self.connect()
        try:
            await asyncio.wait_for(self._js.account_info(), self.settings.connect_timeout)
        except _ANSWER_ERRORS as exc:
            raise BrokerUnavailable(f"{self.name}: NATS does not answer: {_describe(exc)}") from exc

    async def close(self) -> None:
        """Close the connection."""
        broker, self._broker, self._js = self._broker, None, None
        if broker is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(broker.stop(), 5)

    async def _collect(self, futures: list[asyncio.Future[Any]]) -> list[PublishResult]:
        if not futures:
            return []
        _, pending = await asyncio.wait(futures, timeout=self.settings.publish_timeout)
        _cancel(list(pending))
        return [_result(f) for f in futures]

    async def _ensure_stream(self) -> None:
        wanted = self.settings.stream
        try:
            info = await self._js.stream_info(wanted.name)
        except nats.js.errors.NotFoundError:
            if not wanted.create:
                raise BrokerError(
                    f"{self.name}: stream {wanted.name!r} does not exist and stream.create is off"
                ) from None
            await self._js.add_stream(
                StreamConfig(
                    name=wanted.name,
                    subjects=list(wanted.subjects),
                    storage=StorageType(wanted.storage),
                    num_replicas=wanted.replicas,
                    max_age=wanted.max_age_seconds,
                    duplicate_window=wanted.duplicate_window_seconds,
                )
            )
            log.info("nats.stream.created", extra={"broker": self.name, "stream": wanted.name})
            return
        except _ANSWER_ERRORS as exc:
            raise BrokerUnavailable(
                f"{self.name}: cannot read stream {wanted.name!r}: {_describe(exc)}"
            ) from exc
        have = list(info.config.subjects or [])
        missing = [s for s in wanted.subjects if not any(subject_matches(h, s) for h in have)]
        if missing:
            raise BrokerError(
                f"{self.name}: stream {wanted.name!r} exists with subjects {have}, "
                f"which do not cover {missing}"
            )


def _result(future: asyncio.Future[Any]) -> PublishResult:
    if future.cancelled():
        return PublishResult.failed("no ack within publish_timeout", retryable=True)
    exc = future.exception()
    if exc is None:
        return PublishResult.acked()
    if isinstance(exc, nats.js.errors.NoStreamResponseError):
        return PublishResult.failed("no stream captures the subject", retryable=False)
    if isinstance(exc, nats.js.errors.BadRequestError):
        return PublishResult.failed(f"rejected by JetStream: {_describe(exc)}", retryable=False)
    if isinstance(exc, nats.js.errors.APIError):
        return PublishResult.failed(f"JetStream error: {_describe(exc)}", retryable=True)
    return PublishResult.failed(_describe(exc), retryable=True)


def _cancel(futures: list[asyncio.Future[Any]]) -> None:
    for future in futures:
        future.cancel()


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    name = type(exc).__name__
    return f"{name}: {text}" if text and text != name else name
