"""Where a partner consumes, besides the destination: the RabbitMQ exchange (and virtual host),
the JetStream stream, the Redis database, the Service Bus entity kind. A partner binds its
queue, consumer or receiver to these by name, so renaming one cuts it off as surely as
changing the destination: the lock records them (``location``) and ``_diff`` calls a change
breaking. The lock's binding also records how RabbitMQ messages are sent (``delivery``:
persistent, mandatory), which a partner relies on as much. The AsyncAPI document carries them
as the protocol's bindings where the spec has one (amqp, kafka) and as ``x-`` extensions where
it has none (a JetStream stream, Redis, Service Bus).
"""

from __future__ import annotations

from typing import Any

from brokers import BrokerSettings
from brokers.settings import (
    KafkaSettings,
    NatsSettings,
    RabbitSettings,
    RedisSettings,
    ServiceBusSettings,
)

__all__ = ["channel_bindings", "delivery", "location", "message_bindings", "operation_bindings"]

_AMQP = "0.3.0"  # the AsyncAPI amqp binding's version
_KAFKA = "0.5.0"  # the AsyncAPI kafka binding's version
_STREAM_KEY = {
    "type": "string",
    "description": "The event's stream key (absent when staged without one): the events of "
    "one stream share a partition, in commit order.",
}


def location(settings: BrokerSettings) -> dict[str, Any]:
    """What a partner's consumer is bound to on this broker, besides each destination
    (``BrokerSettings.location``, which ``router preview`` shows as well)."""
    return settings.location()


def channel_bindings(settings: BrokerSettings, destination: str) -> dict[str, Any]:
    """The channel's members that say where it is: ``bindings`` and ``x-`` extensions."""
    where = location(settings)
    if isinstance(settings, RabbitSettings):
        exchange = {**where["exchange"], "autoDelete": False, "vhost": where["vhost"]}
        amqp = {"is": "routingKey", "exchange": exchange, "bindingVersion": _AMQP}
        return {"bindings": {"amqp": amqp}}
    if isinstance(settings, KafkaSettings):
        return {"bindings": {"kafka": {"topic": destination, "bindingVersion": _KAFKA}}}
    # The nats binding has no channel fields (its operation binding names a queue group
    # only), and redis and amqp1 have none at all: what a partner needs goes in extensions.
    if isinstance(settings, NatsSettings):
        return {"x-jetstream": {"stream": where["stream"], "subject": destination}}
    if isinstance(settings, RedisSettings):
        return {"x-redis": {"stream": destination, "db": where["db"]}}
    if isinstance(settings, ServiceBusSettings):
        return {"x-servicebus": {**where, "name": destination}}
    return {}


def delivery(settings: BrokerSettings) -> dict[str, bool]:
    """How the router sends, where a partner can tell: RabbitMQ's ``persistent`` (whether
    its messages survive a broker restart) and ``mandatory`` (whether one no queue is bound
    to is refused and retried, or dropped). Nothing elsewhere."""
    if isinstance(settings, RabbitSettings):
        return {"persistent": settings.persistent, "mandatory": settings.mandatory}
    return {}


def operation_bindings(settings: BrokerSettings) -> dict[str, Any]:
    """How the router sends (``delivery``), as AsyncAPI's amqp operation binding."""
    sent = delivery(settings)
    if not sent:
        return {}
    amqp = {
        "deliveryMode": 2 if sent["persistent"] else 1,
        "mandatory": sent["mandatory"],
        "bindingVersion": _AMQP,
    }
    return {"amqp": amqp}


def message_bindings(settings: BrokerSettings, event_type: str) -> dict[str, Any]:
    """The AMQP message type (the event type) and the Kafka record key (the stream key)."""
    if isinstance(settings, RabbitSettings):
        return {"amqp": {"messageType": event_type, "bindingVersion": _AMQP}}
    if isinstance(settings, KafkaSettings):
        return {"kafka": {"key": dict(_STREAM_KEY), "bindingVersion": _KAFKA}}
    return {}
