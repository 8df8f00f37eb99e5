"""Kafka broker (``type: kafka``)."""

from brokers.kafka._settings import KafkaSasl, KafkaSettings

try:
    from brokers.kafka._adapter import KafkaBroker
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "The Kafka broker needs FastStream's Kafka extra: pip install 'outbox-router[kafka]'"
    ) from exc

__all__ = ["KafkaBroker", "KafkaSasl", "KafkaSettings"]
