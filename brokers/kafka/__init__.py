"""Kafka broker (``type: kafka``); the adapter and its SDK load on first use."""

from typing import TYPE_CHECKING

from brokers._lazy import adapter_getattr
from brokers.kafka._settings import KafkaSasl, KafkaSettings

if TYPE_CHECKING:
    from brokers.kafka._adapter import KafkaBroker

__all__ = ["KafkaBroker", "KafkaSasl", "KafkaSettings"]

__getattr__ = adapter_getattr(
    __name__, {"KafkaBroker": KafkaSettings.adapter}, kind="kafka", extra=KafkaSettings.extra
)
