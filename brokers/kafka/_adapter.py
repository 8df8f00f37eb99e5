"""Kafka adapter (FastStream's KafkaBroker over aiokafka).

Each message goes to its destination topic with the stream key as record key, so one stream
stays on one partition and in order; ``acks="all"`` and, by default, the idempotent producer.
The message id, type and correlation id travel as headers. FastStream's ``publish`` returns
once the record is acknowledged; messages of different streams are in flight together.

A record carries exactly ``KafkaSettings.native_headers`` and ``native_properties``: the
record's timestamp is the event's time, and FastStream makes up no ``correlation_id`` header
(its default is a random one per publish, so a replay would differ from the first send).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import aiokafka.errors as kafka_errors
import orjson
from faststream.kafka import KafkaBroker as FastStreamKafka

from brokers._describe import describe
from brokers._faststream import FastStreamAdapter
from brokers._protocol import OutgoingMessage, PublishResult
from brokers.kafka._settings import KafkaSettings
from brokers.ordering import publish_in_order
from envelopes import BrokerUnavailable

__all__ = ["KafkaBroker"]

log = logging.getLogger(__name__)

_UNAVAILABLE: tuple[type[BaseException], ...] = (
    kafka_errors.KafkaConnectionError,
    kafka_errors.NodeNotReadyError,
    kafka_errors.KafkaTimeoutError,
    kafka_errors.RequestTimedOutError,
    ConnectionError,
    OSError,
)
_PERMANENT: tuple[type[BaseException], ...] = (
    kafka_errors.MessageSizeTooLargeError,
    kafka_errors.RecordListTooLargeError,
    kafka_errors.TopicAuthorizationFailedError,
    kafka_errors.InvalidTopicError,
    kafka_errors.UnknownTopicOrPartitionError,
    kafka_errors.UnsupportedVersionError,
)


class KafkaBroker(FastStreamAdapter):
    """Publishes to Kafka topics; see ``brokers._protocol`` for the contract."""

    kind = "Kafka"
    settings: KafkaSettings

    def __init__(self, name: str, settings: KafkaSettings) -> None:
        super().__init__(name, settings)

    def _make(self) -> Any:
        settings = self.settings
        options: dict[str, Any] = {
            "acks": "all",
            "enable_idempotence": settings.idempotent,
            "compression_type": None if settings.compression == "none" else settings.compression,
            "max_request_size": settings.max_request_size,
            "request_timeout_ms": int(settings.publish_timeout * 1000),
            "client_id": f"outbox-router:{self.name}",
            "logger": None,
            # Called when publish gets no correlation id: "" adds no header at all.
            "id_generator": _no_correlation_id,
        }
        security = _security(settings)
        if security is not None:
            options["security"] = security
        return FastStreamKafka(settings.servers(), **options)

    async def publish(self, batch: Sequence[OutgoingMessage]) -> list[PublishResult]:
        """Send every message and wait for its acknowledgement; streams in order."""
        broker = await self._connected()

        settings = self.settings

        async def send(message: OutgoingMessage) -> str:
            wire = message.wire
            record = settings.native_properties(wire)
            key = record.get("key")
            timestamp = record.get("timestamp")
            try:
                landed = await broker.publish(
                    wire.body,
                    topic=message.destination,
                    key=key.encode() if isinstance(key, str) else None,
                    timestamp_ms=timestamp if isinstance(timestamp, int) else None,
                    headers=settings.native_headers(wire),
                )
            except _UNAVAILABLE as exc:
                raise BrokerUnavailable(f"{self.name}: Kafka unreachable: {describe(exc)}") from exc
            return _receipt(landed)

        return await publish_in_order(
            batch, send, _classify, concurrency=self.settings.max_in_flight
        )


def _no_correlation_id() -> str:
    return ""


def _receipt(landed: Any) -> str:
    """Where the record landed: its topic, partition and offset (aiokafka's RecordMetadata)."""
    return orjson.dumps(
        {"topic": landed.topic, "partition": landed.partition, "offset": landed.offset}
    ).decode()


def _classify(exc: Exception) -> PublishResult:
    if isinstance(exc, _PERMANENT):
        return PublishResult.failed(f"rejected by Kafka: {describe(exc)}", retryable=False)
    retriable = getattr(exc, "retriable", True)
    return PublishResult.failed(f"Kafka error: {describe(exc)}", retryable=bool(retriable))


def _security(settings: KafkaSettings) -> Any:
    from faststream.security import (
        BaseSecurity,
        SASLPlaintext,
        SASLScram256,
        SASLScram512,
    )

    ssl = None
    if settings.tls:
        import ssl as ssl_module

        ssl = ssl_module.create_default_context()
    if settings.sasl is None:
        return BaseSecurity(ssl_context=ssl) if ssl is not None else None
    kinds = {"PLAIN": SASLPlaintext, "SCRAM-SHA-256": SASLScram256, "SCRAM-SHA-512": SASLScram512}
    kind = kinds[settings.sasl.mechanism]
    return kind(
        username=settings.sasl.username,
        password=settings.sasl.password.get_secret_value(),
        ssl_context=ssl,
    )
