"""Redis Streams broker (``type: redis``)."""

from brokers.redis._settings import RedisSettings

try:
    from brokers.redis._adapter import RedisBroker
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "The Redis broker needs FastStream's Redis extra: pip install 'outbox-router[redis]'"
    ) from exc

__all__ = ["RedisBroker", "RedisSettings"]
