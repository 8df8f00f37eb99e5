"""Envelope models (internal, external, CloudEvents) and their rendering into wire messages."""

from envelopes.errors import (
    BrokerError,
    BrokerUnavailable,
    ConfigError,
    DatabaseError,
    EnvelopeError,
    MissingDestination,
    PublishError,
    RouterError,
    SchemaError,
    StagingError,
)
from envelopes.identify import message_id_of
from envelopes.ids import uuid7
from envelopes.models import (
    EXTERNAL_FIELDS,
    INTERNAL_ONLY_FIELDS,
    CloudEvent,
    ExternalEnvelope,
    InternalEnvelope,
)
from envelopes.render import (
    PROFILES,
    HeaderName,
    Profile,
    WireMessage,
    check_cloudevents_extensions,
    format_time,
    make_internal_envelope,
    render,
)

__all__ = [
    "EXTERNAL_FIELDS",
    "INTERNAL_ONLY_FIELDS",
    "PROFILES",
    "BrokerError",
    "BrokerUnavailable",
    "CloudEvent",
    "ConfigError",
    "DatabaseError",
    "EnvelopeError",
    "ExternalEnvelope",
    "HeaderName",
    "InternalEnvelope",
    "MissingDestination",
    "Profile",
    "PublishError",
    "RouterError",
    "SchemaError",
    "StagingError",
    "WireMessage",
    "check_cloudevents_extensions",
    "format_time",
    "make_internal_envelope",
    "message_id_of",
    "render",
    "uuid7",
]
