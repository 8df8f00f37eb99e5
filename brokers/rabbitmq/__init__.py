"""RabbitMQ broker (``type: rabbitmq``)."""

from brokers.rabbitmq._settings import RabbitExchange, RabbitSettings

try:
    from brokers.rabbitmq._adapter import RabbitBroker
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "The RabbitMQ broker needs FastStream's RabbitMQ extra: "
        "pip install 'outbox-router[rabbitmq]'"
    ) from exc

__all__ = ["RabbitBroker", "RabbitExchange", "RabbitSettings"]
