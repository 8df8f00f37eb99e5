"""RabbitMQ broker (``type: rabbitmq``); the adapter and its SDK load on first use."""

from typing import TYPE_CHECKING

from brokers._lazy import adapter_getattr
from brokers.rabbitmq._settings import RabbitExchange, RabbitSettings

if TYPE_CHECKING:
    from brokers.rabbitmq._adapter import RabbitBroker

__all__ = ["RabbitBroker", "RabbitExchange", "RabbitSettings"]

__getattr__ = adapter_getattr(
    __name__, {"RabbitBroker": RabbitSettings.adapter}, kind="rabbitmq", extra=RabbitSettings.extra
)
