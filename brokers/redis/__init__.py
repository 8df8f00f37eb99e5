"""Redis Streams broker (``type: redis``); the adapter and its SDK load on first use."""

from typing import TYPE_CHECKING

from brokers._lazy import adapter_getattr
from brokers.redis._settings import RedisSettings

if TYPE_CHECKING:
    from brokers.redis._adapter import RedisBroker

__all__ = ["RedisBroker", "RedisSettings"]

__getattr__ = adapter_getattr(
    __name__, {"RedisBroker": RedisSettings.adapter}, kind="redis", extra=RedisSettings.extra
)
