"""NATS JetStream broker (``type: nats``)."""

from brokers.nats._settings import NatsEmbedded, NatsSettings, NatsStream, subject_matches

try:
    from brokers.nats._adapter import NatsBroker
    from brokers.nats._embedded import EmbeddedNats, find_nats_server
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("The NATS broker needs nats-py: pip install 'outbox-router[nats]'") from exc

__all__ = [
    "EmbeddedNats",
    "NatsBroker",
    "NatsEmbedded",
    "NatsSettings",
    "NatsStream",
    "find_nats_server",
    "subject_matches",
]
