"""An event's metadata (everything it carries besides its identity and payload), defined once.

Each field is declared here, once, with its type, default, description and how it travels
besides the body (``Wire``: a transport header, a CloudEvents attribute). Partners may
receive the fields of ``PartnerMetadata``; ``Metadata`` adds the internal-only ones. The
rest derives from these two classes and ``StageOptions``: the envelope models
(``envelopes.models``), the stored envelope and its rendering (``envelopes.render``), what a
broker may ``omit``, and the keyword arguments of ``Outbox.stage()``.

Adding a field takes two edits: declare it on ``PartnerMetadata`` or ``Metadata``, and add
its keyword to ``StageOptions`` (a test keeps the two in step).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.fields import FieldInfo
from typing_extensions import TypedDict

__all__ = [
    "MAX_SKIPPED_NAMED",
    "METADATA_DEFAULTS",
    "PARTNER_FIELDS",
    "EnvelopeMetadata",
    "HeaderName",
    "Metadata",
    "PartnerMetadata",
    "StageOptions",
    "Wire",
    "wire_of",
]


MAX_SKIPPED_NAMED = 100
"""The most message ids a gap marker names (3.7 KB of header). A stream after a flood of
abandoned rows would otherwise name them all in one header: past about 3,500 ids RabbitMQ
closes the connection (frame_too_large), Service Bus and Kafka refuse the message, and the
row would fail for as long as the gap stays open."""


class HeaderName:
    """Transport header names set on every message (user headers cannot override them)."""

    MESSAGE_ID = "message-id"
    EVENT_TYPE = "event-type"
    EVENT_VERSION = "event-version"
    SOURCE = "source"
    STREAM = "stream-key"
    CORRELATION_ID = "correlation-id"
    CAUSATION_ID = "causation-id"
    TRACEPARENT = "traceparent"
    CONTENT_TYPE = "content-type"
    SKIPPED = "skipped-message-ids"
    """The message ids this message's stream skipped on its target since the last message
    delivered on it (rows abandoned: refused for good, or out of attempts), oldest first,
    comma-separated; only on a message that follows such a gap. At most ``MAX_SKIPPED_NAMED``
    (the oldest); ``skipped-count`` then says how many there were."""
    SKIPPED_COUNT = "skipped-count"
    """How many message ids the gap held, only when ``skipped-message-ids`` names fewer (the
    oldest ``MAX_SKIPPED_NAMED``)."""
    TRANSACTION_ID = "transaction-id"
    """On a target with ``atomic``: the message id of the first event of this message's
    transaction for the target, the same on every member (a broker's own unit may hold
    several transactions)."""
    TRANSACTION_SIZE = "transaction-size"
    """On a target with ``atomic``: how many messages that transaction holds for the target."""


@dataclass(frozen=True, slots=True)
class Wire:
    """How a metadata field travels besides the body, when it is set and not omitted."""

    header: str | None = None  # the transport header carrying it
    cloudevents: str | None = None  # the CloudEvents attribute carrying it


class PartnerMetadata(BaseModel):
    """The metadata partners may receive (in the external and CloudEvents profiles)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stream: Annotated[str | None, Wire(HeaderName.STREAM, "subject")] = Field(
        None, description="Stream key (aggregate id); order holds per key."
    )
    correlation_id: Annotated[str | None, Wire(HeaderName.CORRELATION_ID, "correlationid")] = Field(
        None, description="Id shared by every event of one business transaction."
    )
    causation_id: Annotated[str | None, Wire(HeaderName.CAUSATION_ID, "causationid")] = Field(
        None, description="Id of the message that caused this event."
    )
    traceparent: Annotated[str | None, Wire(HeaderName.TRACEPARENT, "traceparent")] = Field(
        None, description="W3C trace context of the writer."
    )
    extensions: dict[str, Any] = Field(
        default_factory=dict,
        description="Attributes for partners (CloudEvents extension attributes).",
    )


class Metadata(PartnerMetadata):
    """All of an event's metadata: what partners may receive, plus the internal-only fields."""

    expected_version: int | None = Field(None, description="Aggregate version the writer saw.")
    asynchronous: bool = Field(True, description="False when the writer awaits the handling.")
    priority: int | None = Field(None, description="Delivery priority, where a broker has one.")
    positions: dict[str, int] | None = Field(None, description="Event-store positions, if any.")
    tenant: str | None = Field(None, description="Tenant the event belongs to.")
    headers: dict[str, str] = Field(
        default_factory=dict, description="Transport headers staged with the event."
    )


class StageOptions(TypedDict, total=False):
    """The metadata keywords of ``Outbox.stage()``: one per ``Metadata`` field but ``stream``
    (given per event as ``stream_key`` or ``stream_keys``). Mappings may be any Mapping."""

    correlation_id: str | None
    causation_id: str | None
    traceparent: str | None
    extensions: Mapping[str, Any] | None
    expected_version: int | None
    asynchronous: bool
    priority: int | None
    positions: Mapping[str, int] | None
    tenant: str | None
    headers: Mapping[str, str] | None


class EnvelopeMetadata(StageOptions, total=False):
    """Every ``Metadata`` field as a keyword (``make_internal_envelope``)."""

    stream: str | None


def _default(info: FieldInfo) -> Any:
    return info.get_default(call_default_factory=True)


# Field name -> default, in declaration order (partner fields first): the stored envelope's
# metadata members, in this order.
METADATA_DEFAULTS: Mapping[str, Any] = {
    name: _default(info) for name, info in Metadata.model_fields.items()
}
PARTNER_FIELDS: frozenset[str] = frozenset(PartnerMetadata.model_fields)


def wire_of(model: type[BaseModel] = Metadata) -> dict[str, Wire]:
    """Field name -> ``Wire`` for every field of ``model`` that travels besides the body."""
    return {
        name: marker
        for name, info in model.model_fields.items()
        for marker in info.metadata
        if isinstance(marker, Wire)
    }
