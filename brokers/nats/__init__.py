"""NATS JetStream broker (``type: nats``); the adapter loads on first use."""

from typing import TYPE_CHECKING

from brokers._lazy import adapter_getattr
from brokers.nats._settings import NatsEmbedded, NatsSettings, NatsStream, subject_matches

if TYPE_CHECKING:
    from brokers.nats._adapter import NatsBroker
    from brokers.nats._embedded import EmbeddedNats, find_nats_server

__all__ = [
    "EmbeddedNats",
    "NatsBroker",
    "NatsEmbedded",
    "NatsSettings",
    "NatsStream",
    "find_nats_server",
    "subject_matches",
]

__getattr__ = adapter_getattr(
    __name__,
    {
        "NatsBroker": NatsSettings.adapter,
        "EmbeddedNats": "brokers.nats._embedded:EmbeddedNats",
        "find_nats_server": "brokers.nats._embedded:find_nats_server",
    },
    kind="nats",
    extra=NatsSettings.extra,
)
