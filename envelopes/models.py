"""Envelope models: what each profile puts on the wire, as pydantic models.

The processor renders envelopes from plain dicts (see ``envelopes.render``) because that is
several times cheaper per message; these models are the documented, validated shape of the
same JSON, for consumers that parse what arrives and for tests that check what was sent.
Their metadata fields come from ``envelopes.metadata``, where each is declared once.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from envelopes.metadata import Metadata, PartnerMetadata

__all__ = [
    "EXTERNAL_FIELDS",
    "INTERNAL_ONLY_FIELDS",
    "CloudEvent",
    "ExternalEnvelope",
    "InternalEnvelope",
]


class Identity(BaseModel):
    """What every profile carries about one event: its id, type, version, time and source."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(description="The event's message id (UUIDv7), the same on every target.")
    type: str = Field(description="The event type name, e.g. 'orders.order_placed'.")
    version: int = Field(1, description="Schema version of the payload.")
    time: datetime = Field(description="When the event was staged (UTC).")
    source: str = Field(description="The service that committed the event.")


# Bases in this order put the identity first, then the metadata, then the class's own fields
# (pydantic collects fields from the last base to the first).
class InternalEnvelope(Metadata, Identity):
    """Everything the owning system knows about one event; sent to the internal broker."""

    sequence: int | None = Field(None, description="Outbox position of this row on its target.")
    skipped: list[str] | None = Field(
        None,
        description="Message ids of earlier events of this stream that this target abandoned "
        "(refused for good, or out of attempts) since the last message delivered on it, oldest "
        "first: the gap before this message. Absent when there is none. At most 100 (the "
        "oldest); skipped_count then says how many the gap held.",
    )
    skipped_count: int | None = Field(
        None,
        description="How many message ids the gap before this message held, when 'skipped' "
        "names only the oldest 100 of them. Absent otherwise.",
    )
    checksum: str = Field(description="'sha256:<hex>' of the payload's JSON bytes.")
    event_class: str | None = Field(None, description="Python path of the event class.")
    payload: dict[str, Any]


class ExternalEnvelope(PartnerMetadata, Identity):
    """What partners get: the internal envelope stripped of internal-only fields, no nulls."""

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
