"""Envelope models (internal, external, CloudEvents) and their rendering into wire messages."""

from envelopes.errors import (
    BrokerError,
    BrokerUnavailable,
    ConfigError,
    DatabaseError,
    DowncastError,
    EnvelopeError,
    MissingDestination,
    PublishError,
    RouterError,
    SchemaError,
    StagingError,
)
from envelopes.exposure import EXPOSABLE_FIELDS, Exposure
from envelopes.identify import message_id_of
from envelopes.ids import uuid7, uuid7_text
from envelopes.metadata import (
    MAX_SKIPPED_NAMED,
    PARTNER_FIELDS,
    EnvelopeMetadata,
    HeaderName,
    Metadata,
    PartnerMetadata,
    StageOptions,
)
from envelopes.models import (
    EXTERNAL_FIELDS,
    INTERNAL_ONLY_FIELDS,
    CloudEvent,
    ExternalEnvelope,
    InternalEnvelope,
)
from envelopes.render import (
    PROFILES,
    EnvelopeTemplate,
    Profile,
    WireMessage,
    check_cloudevents_extensions,
    format_time,
    make_internal_envelope,
    render,
)

__all__ = [
    "EXPOSABLE_FIELDS",
    "EXTERNAL_FIELDS",
    "INTERNAL_ONLY_FIELDS",
    "MAX_SKIPPED_NAMED",
    "PARTNER_FIELDS",
    "PROFILES",
    "BrokerError",
    "BrokerUnavailable",
    "CloudEvent",
    "ConfigError",
    "DatabaseError",
    "DowncastError",
    "EnvelopeError",
    "EnvelopeMetadata",
    "EnvelopeTemplate",
    "Exposure",
    "ExternalEnvelope",
    "HeaderName",
    "InternalEnvelope",
    "Metadata",
    "MissingDestination",
    "PartnerMetadata",
    "Profile",
    "PublishError",
    "RouterError",
    "SchemaError",
    "StageOptions",
    "StagingError",
    "WireMessage",
    "check_cloudevents_extensions",
    "format_time",
    "make_internal_envelope",
    "message_id_of",
    "render",
    "uuid7",
    "uuid7_text",
]
