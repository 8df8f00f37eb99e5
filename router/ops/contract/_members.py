"""The schemas of a partner message's members: the envelope's fields and CloudEvents
attributes (from the envelope models, nulls left out as render leaves them out) and the
transport headers (every value a string) and the broker's own message properties, with the
values fixed per event version as ``const``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from brokers import BrokerSettings
from envelopes import HeaderName, InternalEnvelope, Metadata
from envelopes.metadata import wire_of
from router.ops.contract._schema import Schema, glob_pattern, without_null

__all__ = [
    "EXTENSIONS",
    "STAGED",
    "attribute_schemas",
    "field_schemas",
    "fixed_values",
    "header_schema",
    "named_object",
    "property_schema",
]

EXTENSIONS = "Extension attributes staged with the event, by name (expose.extensions)."
STAGED = "Headers staged with the event, by name (expose.headers)."


def named_object(globs: tuple[str, ...], description: str, *, string: bool = False) -> Schema:
    """An object whose member names match case-insensitive ``globs``."""
    value: Schema = {"type": "string"} if string else {}
    return {
        "type": "object",
        "description": f"{description} Names: {', '.join(globs)} (any case).",
        "patternProperties": {glob_pattern(glob): dict(value) for glob in globs},
    }


def fixed_values(event_type: str, version: int, service: str, content_type: str) -> dict[str, Any]:
    """Members whose value is the same in every message of one event version."""
    return {
        "type": event_type,
        "version": version,
        "source": service,
        "specversion": "1.0",
        "datacontenttype": "application/json",
        "eventversion": version,
        HeaderName.EVENT_TYPE: event_type,
        HeaderName.EVENT_VERSION: str(version),
        HeaderName.SOURCE: service,
        HeaderName.CONTENT_TYPE: content_type,
    }


def _envelope_properties() -> dict[str, Schema]:
    schema = InternalEnvelope.model_json_schema(mode="serialization")
    return {name: without_null(value) for name, value in schema["properties"].items()}


def field_schemas(fixed: Mapping[str, Any]) -> dict[str, Schema]:
    """The external (or internal) envelope's members, nulls left out as render does."""
    schemas = _envelope_properties()
    for name in ("type", "version", "source"):
        schemas[name] = {**schemas[name], "const": fixed[name]}
    return {name: {k: v for k, v in s.items() if k != "default"} for name, s in schemas.items()}


_CE_OWN = {
    "specversion": {"type": "string", "description": "The CloudEvents specification version."},
    "datacontenttype": {"type": "string", "description": "The media type of data."},
    "eventversion": {"type": "integer", "description": "Schema version of data."},
}


def attribute_schemas(fixed: Mapping[str, Any]) -> dict[str, Schema]:
    """The CloudEvents attributes: the identity and metadata fields they carry, named as
    their ``Wire`` marks say, and the attributes of CloudEvents itself."""
    fields = field_schemas(fixed)
    schemas = {name: fields[name] for name in ("id", "source", "type", "time")}
    for field, wire in wire_of().items():
        if wire.cloudevents:
            schemas[wire.cloudevents] = fields[field]
    for name, own in _CE_OWN.items():
        schemas[name] = {**own, "const": fixed[name]}
    return schemas


_HEADER_DESCRIPTIONS = {
    HeaderName.MESSAGE_ID: "The event's message id (UUIDv7), the same on every target: "
    "deduplicate on it.",
    HeaderName.EVENT_TYPE: "The event type name.",
    HeaderName.EVENT_VERSION: "Schema version of the payload.",
    HeaderName.SOURCE: "The service that committed the event.",
    HeaderName.CONTENT_TYPE: "The media type of the body.",
    HeaderName.SKIPPED: "Only after a gap in the stream: the message ids of the events of this "
    "stream key that this broker's target abandoned (refused for good, or out of attempts) "
    "since the last message delivered on it, oldest first, comma-separated. They will not "
    "come unless an operator requeues them. At most 100, the oldest; skipped-count then says "
    "how many there were.",
    HeaderName.SKIPPED_COUNT: "Only after a gap of more than 100 events: how many message ids "
    "the gap held (skipped-message-ids names the oldest 100).",
    # Added by the adapters (BrokerSettings.native_headers).
    "Nats-Msg-Id": "The event's message id again: the key of JetStream's duplicate window.",
    # On every message of a target with atomic: true (BrokerSettings.unit_headers).
    HeaderName.TRANSACTION_ID: "The message id of the first event of the transaction this "
    "message was committed in, the same on each of them: the events one transaction committed "
    "for this partner arrive together, all or none.",
    HeaderName.TRANSACTION_SIZE: "How many messages that transaction holds for this partner.",
    "Nats-Batch-Id": "The atomic batch this message was stored in: one or more whole "
    "transactions (see transaction-id), at contiguous stream sequences, all or none.",
    "Nats-Batch-Sequence": "This message's place in its batch, from 1.",
    "Nats-Batch-Commit": "On the batch's last message only: 1.",
    "correlation_id": "The staged correlation id again, under the name some Kafka client "
    "frameworks read it by.",
}

# The broker's own properties (BrokerSettings.native_properties), by kind and name.
_PROPERTY_DESCRIPTIONS = {
    "message_id": "The event's message id (UUIDv7): deduplicate on it.",
    "correlation_id": "The correlation id staged with the event.",
    "content_type": "The media type of the body.",
    "type": "The event type name.",
    "subject": "The event type name.",
    "delivery_mode": "2: persistent (the broker's persistent setting); 1: not.",
    "priority": "The priority staged with the event.",
    "key": "The stream key: a stream stays on one partition, in order.",
    "session_id": "The stream key (session-enabled entities).",
}


def property_schema(
    settings: BrokerSettings, name: str, value: str | int, fixed: Mapping[str, Any]
) -> Schema:
    """A native message property's schema, from one sample value of it."""
    schema: Schema = {"type": "integer" if isinstance(value, int) else "string"}
    described = settings.property_descriptions.get(name)
    description = described or _PROPERTY_DESCRIPTIONS.get(name)
    if description:
        schema["description"] = description
    if name in ("type", "subject"):
        schema["const"] = fixed["type"]
    elif name == "content_type":
        schema["const"] = fixed[HeaderName.CONTENT_TYPE]
    elif name == "delivery_mode":
        schema["const"] = value
    return schema


def header_schema(header: str, settings: BrokerSettings, fixed: Mapping[str, Any]) -> Schema:
    """A transport header's schema (every header value is a string)."""
    prefix = settings.binary_prefix
    if prefix and header.startswith(prefix):
        attribute = attribute_schemas(fixed).get(header.removeprefix(prefix), {})
        schema: Schema = {"type": "string"}
        if "description" in attribute:
            schema["description"] = attribute["description"]
        if "const" in attribute:
            schema["const"] = str(attribute["const"])
        return schema
    schema = {"type": "string"}
    by_header = {wire.header: field for field, wire in wire_of().items() if wire.header}
    description = _HEADER_DESCRIPTIONS.get(header)
    if description is None and header in by_header:
        description = Metadata.model_fields[by_header[header]].description
    if description:
        schema["description"] = description
    if header in fixed:
        schema["const"] = fixed[header]
    return schema
