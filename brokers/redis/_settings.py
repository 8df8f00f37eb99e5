"""Settings of the Redis Streams broker (``type: redis``)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator

from brokers._lazy import install_hint, missing_modules
from brokers._settings import BrokerSettings, redact_url
from envelopes import WireMessage

__all__ = ["BODY_FIELD", "FASTSTREAM_CORRELATION", "RedisSettings"]

BODY_FIELD = "body"
"""The field of a plain entry that holds the body."""
FASTSTREAM_CORRELATION = "correlation_id"  # the header FastStream's frame adds


class RedisSettings(BrokerSettings):
    """Redis Streams: one XADD per message to the destination stream."""

    type: Literal["redis"] = Field(description="A Redis Streams broker.")
    adapter: ClassVar[str] = "brokers.redis._adapter:RedisBroker"
    extra: ClassVar[str | None] = "redis"
    # What every format needs; ``format: faststream`` also needs FastStream (missing_client).
    client_modules: ClassVar[tuple[str, ...]] = ("redis",)
    title: ClassVar[str | None] = "Redis Streams"
    asyncapi_protocol: ClassVar[str | None] = "redis"
    no_atomic_unit: ClassVar[str | None] = None
    atomic_unit: ClassVar[str | None] = (
        "one Lua script (MULTI/EXEC for a user without scripting) on one Redis node: the "
        "entries follow one another in each stream"
    )
    max_unit: ClassVar[int | None] = 1000  # redis _adapter.MAX_UNIT

    url: SecretStr = Field(
        SecretStr("redis://127.0.0.1:6379/0"), description="The Redis URL, credentials included."
    )
    maxlen: int | None = Field(
        None, ge=1, description="Trim each stream to about this many entries (XADD MAXLEN ~)."
    )
    max_in_flight: int = Field(256, ge=1, description="XADDs awaiting their reply at most.")
    format: Literal["plain", "faststream"] = Field(
        "plain",
        description="plain: each entry has a 'body' field and one field per header, for any "
        "Redis client; faststream: FastStream's binary frame (internal broker only).",
    )

    duplicate_window_seconds: float = Field(
        120.0,
        description="With atomic: true, seconds each unit's marker key (router:unit:*) is "
        "kept: a unit sent again within it (its answer lost to a cut connection or a killed "
        "relay) is recognised as stored, not stored twice. Keep it above the retry horizon "
        "(router check warns).",
    )

    @field_validator("duplicate_window_seconds")
    @classmethod
    def _window_covers_a_retry(cls, seconds: float) -> float:
        if seconds < 1:
            raise ValueError(
                f"{seconds:g} s is too short: a unit sent again after a lost answer comes "
                "seconds later at the soonest (a lease, a publish's limit); give at least 1 "
                "second, 120 by default"
            )
        return seconds

    @model_validator(mode="after")
    def _faststream_only_internal(self) -> RedisSettings:
        if self.format == "faststream" and not self.internal:
            raise ValueError(
                "format: faststream is for the internal broker (internal: true) only; "
                "partners read format: plain with any Redis client"
            )
        return self

    def missing_client(self) -> str | None:
        """What to install when a client library this format needs is missing; else None."""
        modules = self.client_modules
        if self.format == "faststream":
            modules = ("faststream", *modules)
        missing = missing_modules(modules)
        return install_hint(self.type, self.extra, missing[0]) if missing else None

    def native_headers(self, wire: WireMessage) -> dict[str, str]:
        """``plain``: the entry's fields besides ``body``: every rendered header but one
        named ``body`` (the body wins). ``faststream``: the headers in FastStream's frame,
        with its ``correlation_id`` (the staged one, else the message id)."""
        if self.format == "faststream":
            correlation = wire.correlation_id or wire.message_id
            return {**wire.headers, FASTSTREAM_CORRELATION: correlation}
        return {k: v for k, v in wire.headers.items() if k != BODY_FIELD}

    def location(self) -> dict[str, Any]:
        """The database number the stream lives in (the URL's path; 0 by default)."""
        path = urlsplit(self.url.get_secret_value()).path.strip("/")
        return {"db": int(path) if path.isdigit() else 0}

    def channel_bindings(self, destination: str) -> dict[str, Any]:
        """The stream and database as ``x-redis``: AsyncAPI's redis binding has no fields."""
        return {"x-redis": {"stream": destination, **self.location()}}

    def check_destination(self, destination: str) -> None:
        """Any non-empty key of reasonable length."""
        if not destination or len(destination) > 1024:
            raise ValueError("a stream name must be 1 to 1024 characters")

    def check_header_name(self, name: str) -> None:
        """Any field name, but ``body`` in the plain format: that field is the body."""
        if self.format == "plain" and name == BODY_FIELD:
            raise ValueError(
                f"a plain Redis entry's {BODY_FIELD!r} field is the body, so no header may "
                "have that name"
            )

    def public_url(self) -> str:
        """The URL without credentials."""
        return redact_url(self.url.get_secret_value())
