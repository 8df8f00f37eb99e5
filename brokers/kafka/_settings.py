"""Settings of the Kafka broker (``type: kafka``)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from brokers._native import NativeProperties, event_millis
from brokers._settings import BrokerSettings, redact_url
from envelopes import WireMessage

__all__ = ["CORRELATION_HEADER", "KAFKA_BINDING", "KafkaSasl", "KafkaSettings"]

CORRELATION_HEADER = "correlation_id"
_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
KAFKA_BINDING = "0.5.0"  # the AsyncAPI kafka binding's version
_STREAM_KEY = {
    "type": "string",
    "description": "The event's stream key (absent when staged without one): the events of "
    "one stream share a partition, in commit order.",
}


class KafkaSasl(BaseModel):
    """SASL credentials (over TLS when ``tls`` is on)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = Field(
        "PLAIN", description="How the credentials are checked."
    )
    username: str = Field(description="The SASL user name.")
    password: SecretStr = Field(description="The SASL password.")


class KafkaSettings(BrokerSettings):
    """Kafka: topic per destination, key = stream key, acks=all, idempotent producer."""

    type: Literal["kafka"] = Field(description="A Kafka broker.")
    adapter: ClassVar[str] = "brokers.kafka._adapter:KafkaBroker"
    extra: ClassVar[str | None] = "kafka"
    client_modules: ClassVar[tuple[str, ...]] = ("faststream", "aiokafka")
    cloudevents_prefix: ClassVar[str] = "ce_"  # the Kafka binding's header prefix
    title: ClassVar[str | None] = "Apache Kafka"
    asyncapi_protocol: ClassVar[str | None] = "kafka"
    no_atomic_unit: ClassVar[str | None] = (
        "an atomic write on Kafka is a producer transaction, which the router does not use (its "
        "idempotent producer writes each record on its own, and tansu, the broker its tests "
        "run on, has no transactions); leave atomic off"
    )
    property_descriptions: ClassVar[Mapping[str, str]] = {
        "timestamp": "The event's time (not the publish time), in milliseconds since the "
        "epoch (the record's CreateTime; a topic with LogAppendTime replaces it).",
    }

    # Plain text on purpose: addresses are not secret (credentials go in `sasl`), and
    # output must still say where a failing broker is.
    bootstrap_servers: str = Field(
        "127.0.0.1:9092", description="host:port of one or more brokers, comma-separated."
    )
    idempotent: bool = Field(
        True, description="Idempotent producer: no duplicates or reordering on retries."
    )
    tls: bool = Field(False, description="Connect over TLS; false: plain text.")
    sasl: KafkaSasl | None = Field(
        None, description="SASL credentials; default: connect without authenticating."
    )
    compression: Literal["none", "gzip", "snappy", "lz4", "zstd"] = Field(
        "none", description="How record batches are compressed; none: not at all."
    )
    max_request_size: int = Field(1_048_576, ge=1024, description="Largest record, in bytes.")
    max_in_flight: int = Field(256, ge=1, description="Messages awaiting their ack at most.")

    def channel_bindings(self, destination: str) -> dict[str, Any]:
        """AsyncAPI's kafka channel binding: the destination is the topic."""
        return {"bindings": {"kafka": {"topic": destination, "bindingVersion": KAFKA_BINDING}}}

    def message_bindings(self, event_type: str) -> dict[str, Any]:
        """The record key: the stream key."""
        return {"kafka": {"key": dict(_STREAM_KEY), "bindingVersion": KAFKA_BINDING}}

    def check_header_name(self, name: str) -> None:
        """Any name: a Kafka record header key is any string."""

    def check_destination(self, destination: str) -> None:
        """A topic name: letters, digits, '.', '_' or '-', at most 249 characters."""
        if not _TOPIC.match(destination) or destination in (".", ".."):
            raise ValueError(f"{destination!r} is not a valid Kafka topic name")

    def native_headers(self, wire: WireMessage) -> dict[str, str]:
        """The rendered headers, and ``correlation_id`` (the name FastStream's consumers read)
        when a correlation id was staged."""
        headers = dict(wire.headers)
        if wire.correlation_id:
            headers[CORRELATION_HEADER] = wire.correlation_id
        return headers

    def native_properties(self, wire: WireMessage) -> NativeProperties:
        """The record's ``key`` (the stream key, when there is one) and ``timestamp`` (the
        event's time, in milliseconds since the epoch)."""
        properties: NativeProperties = {}
        if wire.stream_key:
            properties["key"] = wire.stream_key
        millis = event_millis(wire)
        if millis is not None:
            properties["timestamp"] = millis
        return properties

    def servers(self) -> list[str]:
        """The bootstrap servers."""
        return [s.strip() for s in self.bootstrap_servers.split(",") if s.strip()]

    def public_url(self) -> str:
        """Servers without credentials."""
        return ",".join(redact_url(f"kafka://{s}") for s in self.servers())
