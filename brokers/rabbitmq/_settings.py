"""Settings of the RabbitMQ broker (``type: rabbitmq``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal, Self
from urllib.parse import unquote, urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from brokers._native import NativeProperties, event_seconds
from brokers._settings import BrokerSettings, redact_url
from envelopes import WireMessage

__all__ = ["AMQP_BINDING", "MAX_HEADER_NAME_BYTES", "RabbitExchange", "RabbitSettings"]

AMQP_BINDING = "0.3.0"  # the AsyncAPI amqp binding's version

MAX_HEADER_NAME_BYTES = 128
"""The longest header name RabbitMQ's client carries whole (pamqp truncates longer ones)."""


class RabbitExchange(BaseModel):
    """The exchange messages are published to (the destination is the routing key)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=255, description="The exchange's name.")
    type: Literal["topic", "direct", "fanout", "headers"] = Field(
        "topic", description="The exchange type it is declared with."
    )
    durable: bool = Field(True, description="Declared to survive a broker restart.")
    declare: bool = Field(True, description="Declare it on connect (else it must exist).")


class RabbitSettings(BrokerSettings):
    """RabbitMQ: persistent messages, publisher confirms, mandatory routing."""

    type: Literal["rabbitmq"] = Field(description="A RabbitMQ broker.")
    adapter: ClassVar[str] = "brokers.rabbitmq._adapter:RabbitBroker"
    extra: ClassVar[str | None] = "rabbitmq"
    client_modules: ClassVar[tuple[str, ...]] = ("faststream", "aio_pika")
    cloudevents_prefix: ClassVar[str] = "cloudEvents:"  # the AMQP binding's prefix
    title: ClassVar[str | None] = "RabbitMQ"
    asyncapi_protocol: ClassVar[str | None] = "amqp"
    asyncapi_protocol_version: ClassVar[str | None] = "0.9.1"
    no_atomic_unit: ClassVar[str | None] = (
        "RabbitMQ confirms each message on its own, and its channel transactions promise no "
        "atomicity across queues; leave atomic off (each row is then delivered on its own)"
    )
    property_descriptions: ClassVar[Mapping[str, str]] = {
        "timestamp": "The event's time (not the publish time), in seconds since the epoch.",
    }

    url: SecretStr = Field(
        SecretStr("amqp://guest:guest@127.0.0.1:5672/"),
        description="The AMQP URL, credentials included.",
    )
    exchange: RabbitExchange = Field(description="The exchange messages are published to.")
    mandatory: bool = Field(
        True,
        description=(
            "A message no queue is bound to is a retryable failure (delivered once a queue is "
            "bound), not silently dropped."
        ),
    )
    persistent: bool = Field(
        True, description="Messages are stored on disk by the broker (delivery mode 2)."
    )
    max_in_flight: int = Field(256, ge=1, description="Messages awaiting their confirm at most.")

    def native_properties(self, wire: WireMessage) -> NativeProperties:
        """The AMQP properties: ``message_id``, ``correlation_id`` (when staged),
        ``content_type``, ``type`` (the event type), ``delivery_mode`` (2: persistent),
        ``timestamp`` (the event's time, in seconds since the epoch) and ``priority`` (when
        staged and the rendered message carries it). No ``app_id``: the ``source`` header
        names the service."""
        properties: NativeProperties = {"message_id": wire.message_id}
        if wire.correlation_id:
            properties["correlation_id"] = wire.correlation_id
        properties["content_type"] = wire.content_type
        properties["type"] = wire.event_type
        properties["delivery_mode"] = 2 if self.persistent else 1
        seconds = event_seconds(wire)
        if seconds is not None:
            properties["timestamp"] = seconds
        if wire.priority is not None:
            properties["priority"] = wire.priority
        return properties

    def location(self) -> dict[str, Any]:
        """The exchange (the destination is its routing key) and the virtual host."""
        exchange = self.exchange
        # As aio-pika reads the URL: the path without its slash, "/" when empty.
        vhost = unquote(urlsplit(self.url.get_secret_value()).path[1:]) or "/"
        return {
            "exchange": {"name": exchange.name, "type": exchange.type, "durable": exchange.durable},
            "vhost": vhost,
        }

    def delivery(self) -> dict[str, bool]:
        """``persistent`` (whether messages survive a broker restart) and ``mandatory``
        (whether one no queue is bound to is refused and retried, or dropped)."""
        return {"persistent": self.persistent, "mandatory": self.mandatory}

    def channel_bindings(self, destination: str) -> dict[str, Any]:
        """AsyncAPI's amqp channel binding: the destination is the exchange's routing key."""
        where = self.location()
        exchange = {**where["exchange"], "autoDelete": False, "vhost": where["vhost"]}
        amqp = {"is": "routingKey", "exchange": exchange, "bindingVersion": AMQP_BINDING}
        return {"bindings": {"amqp": amqp}}

    def operation_bindings(self) -> dict[str, Any]:
        """``delivery`` as AsyncAPI's amqp operation binding."""
        amqp = {
            "deliveryMode": 2 if self.persistent else 1,
            "mandatory": self.mandatory,
            "bindingVersion": AMQP_BINDING,
        }
        return {"amqp": amqp}

    def message_bindings(self, event_type: str) -> dict[str, Any]:
        """The AMQP message type: the event type."""
        return {"amqp": {"messageType": event_type, "bindingVersion": AMQP_BINDING}}

    def check_destination(self, destination: str) -> None:
        """A routing key of at most 255 bytes."""
        if len(destination.encode()) > 255:
            raise ValueError(f"routing key {destination[:40]!r}... is longer than 255 bytes")

    def check_header_name(self, name: str) -> None:
        """At most 128 bytes: the AMQP client (pamqp) cuts a longer field name there, with
        only a log line, so the consumer would see another name. Any characters."""
        if len(name.encode()) > MAX_HEADER_NAME_BYTES:
            raise ValueError(
                f"a RabbitMQ header name is at most {MAX_HEADER_NAME_BYTES} bytes (UTF-8)"
            )

    def creates(self) -> str | None:
        """The exchange, when ``exchange.declare`` is on."""
        return f"exchange {self.exchange.name!r}" if self.exchange.declare else None

    def without_creating(self) -> Self:
        """These settings with ``exchange.declare`` off."""
        declare_off = self.exchange.model_copy(update={"declare": False})
        return self.model_copy(update={"exchange": declare_off})

    def public_url(self) -> str:
        """The URL without credentials."""
        return redact_url(self.url.get_secret_value())
