"""Every broker kind's settings, as one discriminated union on ``type`` (used by config)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from brokers._settings import BrokerSettings, EventFilter, EventRoute, redact_url
from brokers.memory import MemorySettings
from brokers.nats._settings import NatsEmbedded, NatsSettings, NatsStream

__all__ = [
    "AnyBrokerSettings",
    "BrokerSettings",
    "EventFilter",
    "EventRoute",
    "MemorySettings",
    "NatsEmbedded",
    "NatsSettings",
    "NatsStream",
    "redact_url",
]

AnyBrokerSettings = Annotated[NatsSettings | MemorySettings, Field(discriminator="type")]
