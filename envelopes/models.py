"""Envelope models: what each profile puts on the wire, as pydantic models.

The processor renders envelopes from plain dicts (see ``envelopes.render``) because that is
several times cheaper per message; these models are the documented, validated shape of the
same JSON, for consumers that parse what arrives and for tests that check what was sent.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "EXTERNAL_FIELDS",
    "INTERNAL_ONLY_FIELDS",
    "CloudEvent",
    "ExternalEnvelope",
    "InternalEnvelope",
]


class InternalEnvelope(BaseModel):
    """Everything the owning system knows about one event; sent to the internal broker."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(description="The event's message id (UUIDv7), the same on every target.")
    type: str = Field(description="The event type name, e.g. 'orders.order_placed'.")
    version: int = Field(1, description="Schema version of the payload.")
    time: datetime = Field(description="When the event was staged (UTC).")
    source: str = Field(description="The service that committed the event.")
    stream: str | None = Field(None, description="Stream key (aggregate id); order holds per key.")
    sequence: int | None = Field(None, description="Outbox position of this row on its target.")
    correlation_id: str | None = None
    causation_id: str | None = None
    expected_version: int | None = Field(None, description="Aggregate version the writer saw.")
    asynchronous: bool = True
    priority: int | None = None
    positions: dict[str, int] | None = Field(None, description="Event-store positions, if any.")
    checksum: str = Field(description="'sha256:<hex>' of the payload's JSON bytes.")
    traceparent: str | None = Field(None, description="W3C trace context of the writer.")
    tenant: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    extensions: dict[str, Any] = Field(default_factory=dict)
    event_class: str | None = Field(None, description="Python path of the event class.")
    payload: dict[str, Any]


class ExternalEnvelope(BaseModel):
    """What partners get: the internal envelope stripped of internal-only fields, no nulls."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    type: str
    version: int = 1
    time: datetime
    source: str
    stream: str | None = None
    correlation_id: str | None = None
    causation_id: str | None = None
    traceparent: str | None = None
    extensions: dict[str, Any] = Field(default_factory=dict)
    payload: dict[str, Any]


class CloudEvent(BaseModel):
    """A CloudEvents 1.0 event in structured JSON mode (extension attributes allowed)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    specversion: Literal["1.0"] = "1.0"
    id: str
    source: str
    type: str
    time: datetime | None = None
    subject: str | None = None
    datacontenttype: str | None = "application/json"
    data: Any = None


EXTERNAL_FIELDS: tuple[str, ...] = tuple(ExternalEnvelope.model_fields)
INTERNAL_ONLY_FIELDS: frozenset[str] = frozenset(InternalEnvelope.model_fields) - frozenset(
    EXTERNAL_FIELDS
)
