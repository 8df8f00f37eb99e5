"""Settings of the Redis Streams broker (``type: redis``)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, SecretStr

from brokers._settings import BrokerSettings, redact_url

__all__ = ["RedisSettings"]


class RedisSettings(BrokerSettings):
    """Redis Streams: one XADD per message to the destination stream."""

    type: Literal["redis"]
    adapter: ClassVar[str] = "brokers.redis._adapter:RedisBroker"
    extra: ClassVar[str | None] = "redis"
    client_modules: ClassVar[tuple[str, ...]] = ("faststream", "redis")
    cloudevents_prefix: ClassVar[str] = "ce_"

    url: SecretStr = Field(SecretStr("redis://127.0.0.1:6379/0"))
    maxlen: int | None = Field(
        None, ge=1, description="Trim each stream to about this many entries (XADD MAXLEN ~)."
    )
    max_in_flight: int = Field(256, ge=1, description="XADDs awaiting their reply at most.")

    def check_destination(self, destination: str) -> None:
        """Any non-empty key of reasonable length."""
        if not destination or len(destination) > 1024:
            raise ValueError("a stream name must be 1 to 1024 characters")

    def public_url(self) -> str:
        """The URL without credentials."""
        return redact_url(self.url.get_secret_value())
