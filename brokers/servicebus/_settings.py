"""Settings of the Azure Service Bus broker (``type: servicebus``)."""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import Field, SecretStr, field_validator

from brokers._native import NativeProperties
from brokers._settings import BrokerSettings, UnsetSecret
from envelopes import WireMessage

__all__ = ["ServiceBusSettings"]

_ENTITY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,259}$")


class ServiceBusSettings(BrokerSettings):
    """Azure Service Bus: a queue or topic per destination, sent in size-limited batches."""

    type: Literal["servicebus"] = Field(description="An Azure Service Bus namespace.")
    adapter: ClassVar[str] = "brokers.servicebus._adapter:ServiceBusBroker"
    extra: ClassVar[str | None] = "servicebus"
    client_modules: ClassVar[tuple[str, ...]] = ("azure.servicebus",)
    cloudevents_prefix: ClassVar[str] = "cloudEvents:"  # the AMQP binding's prefix
    title: ClassVar[str | None] = "Azure Service Bus"
    # Service Bus speaks AMQP 1.0, whose AsyncAPI binding is named amqp1.
    asyncapi_protocol: ClassVar[str | None] = "amqp1"
    asyncapi_protocol_version: ClassVar[str | None] = "1.0"
    no_atomic_unit: ClassVar[str | None] = None
    atomic_unit: ClassVar[str | None] = "one Service Bus batch to one queue or topic"
    max_unit: ClassVar[int | None] = 4500  # a Service Bus batch's most (_adapter.MAX_UNIT)

    connection_string: SecretStr = Field(
        description="Endpoint=sb://<namespace>/;SharedAccessKeyName=...;SharedAccessKey=..."
    )
    entity: Literal["queue", "topic"] = Field(
        "queue", description="Whether destinations name queues or topics."
    )
    sessions: bool = Field(
        False, description="The entity is session-enabled: session_id = the stream key."
    )

    @field_validator("connection_string")
    @classmethod
    def _has_endpoint(cls, value: SecretStr) -> SecretStr:
        if isinstance(value, UnsetSecret):  # loaded to stage events: nothing to check
            return value
        if "endpoint=" not in value.get_secret_value().lower():
            raise ValueError("a Service Bus connection string starts with Endpoint=sb://...")
        return value

    def location(self) -> dict[str, Any]:
        """Whether the destination names a queue or a topic, and whether it has sessions."""
        return {"entity": self.entity, "sessions": self.sessions}

    def channel_bindings(self, destination: str) -> dict[str, Any]:
        """The entity as ``x-servicebus``: AsyncAPI's amqp1 binding has no fields."""
        return {"x-servicebus": {**self.location(), "name": destination}}

    def native_properties(self, wire: WireMessage) -> NativeProperties:
        """The message's own properties: ``message_id`` (the key of duplicate detection),
        ``correlation_id`` (when staged), ``subject`` (the event type), ``content_type``
        and, on a session-enabled entity, ``session_id`` (the stream key). The rendered
        headers are its application properties."""
        properties: NativeProperties = {"message_id": wire.message_id}
        if wire.correlation_id:
            properties["correlation_id"] = wire.correlation_id
        properties["subject"] = wire.event_type
        properties["content_type"] = wire.content_type
        if self.sessions and wire.stream_key:
            properties["session_id"] = wire.stream_key
        return properties

    def check_header_name(self, name: str) -> None:
        """Any name: an application property key is any string."""

    def check_destination(self, destination: str) -> None:
        """A queue or topic name (letters, digits, '.', '_', '-', '/'; at most 260)."""
        if not _ENTITY.match(destination):
            raise ValueError(f"{destination!r} is not a valid Service Bus entity name")

    def public_url(self) -> str:
        """The namespace endpoint, without keys."""
        for part in self.connection_string.get_secret_value().split(";"):
            name, _, value = part.partition("=")
            if name.strip().lower() == "endpoint":
                return value.strip()
        return ""
