"""Settings shared by every broker kind: role, envelope profile, what a partner receives
(``expose``), event filter, destinations."""

from __future__ import annotations

import fnmatch
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, Self
from urllib.parse import urlsplit, urlunsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from brokers._expose import Expose
from brokers._lazy import install_hint, missing_modules
from brokers._native import NativeProperties
from envelopes import (
    INTERNAL_ONLY_FIELDS,
    PARTNER_FIELDS,
    ConfigError,
    Exposure,
    HeaderName,
    Profile,
    WireMessage,
    render,
)

__all__ = [
    "BrokerSettings",
    "EmbeddedServer",
    "EventFilter",
    "EventRoute",
    "ServerInUse",
    "UnsetSecret",
    "redact_url",
]

PLACEHOLDERS = frozenset({"event_type", "destination", "version", "service"})
# What a broker may leave out: any metadata partners may see, and the staged headers.
_OMITTABLE = PARTNER_FIELDS | {"headers"}


class ServerInUse(ConfigError):
    """Another running router already runs this embedded server (same store and port).

    A ``ConfigError``: two routers were given one store; the second must not take it over.
    """


class UnsetSecret(SecretStr):
    """A secret setting whose environment variable was unset when the config was loaded only
    to stage events (``Outbox.from_file``), which never reads it: connecting to the broker
    does, and reading it raises ConfigError naming the YAML path and the variable."""

    def __init__(self, problem: str) -> None:
        super().__init__("")
        self.problem = problem

    def get_secret_value(self) -> str:
        """Raise ConfigError: there is no value."""
        raise ConfigError(
            f"{self.problem} (this config was loaded to stage events, which does not need it)"
        )

    # SecretStr compares and hashes its value; this one has none to give.
    def __eq__(self, other: object) -> bool:
        return isinstance(other, UnsetSecret) and other.problem == self.problem

    def __hash__(self) -> int:
        return hash(self.problem)


class EmbeddedServer(Protocol):
    """A broker server the router runs itself (the embedded default's NATS)."""

    address: str

    async def start(self) -> None:
        """Start it and wait until it accepts connections."""

    async def stop(self) -> None:
        """Stop it."""

    async def port_open(self) -> bool:
        """True when something accepts connections on its address."""

    def owner_pid(self) -> int | None:
        """The pid of a running server on this store started by a router; None otherwise."""


@dataclass(frozen=True, slots=True)
class EventRoute:
    """What a destination template may use about one event."""

    event_type: str
    version: int
    service: str
    destination: str | None = None

    def fields(self) -> dict[str, Any]:
        """Values for a destination template; ``destination`` defaults to the event type."""
        return {
            "event_type": self.event_type,
            "version": self.version,
            "service": self.service,
            "destination": self.destination or self.event_type,
        }


class EventFilter(BaseModel):
    """Which event types an external broker receives: glob patterns on the type name."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    include: list[str] = Field(
        default_factory=lambda: ["*"],
        min_length=1,
        description="Glob patterns of the event types sent; default: every published type.",
    )
    exclude: list[str] = Field(
        default_factory=list,
        description="Glob patterns of event types not sent, even when included; default: none.",
    )

    def matches(self, event_type: str) -> bool:
        """True when the type matches an include pattern and no exclude pattern."""
        return any(fnmatch.fnmatchcase(event_type, p) for p in self.include) and not any(
            fnmatch.fnmatchcase(event_type, p) for p in self.exclude
        )


class RateLimit(BaseModel):
    """At most ``messages_per_second`` to this target, with bursts of up to ``burst``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    messages_per_second: float = Field(
        gt=0, description="The steady rate allowed, in messages per second."
    )
    burst: int | None = Field(
        None,
        ge=1,
        description="Messages sent at once after a quiet spell; default: one "
        "second's worth (at least 1).",
    )

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        # rate_limit: 200 is rate_limit: {messages_per_second: 200}
        if isinstance(value, int | float) and not isinstance(value, bool):
            return {"messages_per_second": value}
        return value

    @property
    def capacity(self) -> int:
        """The bucket's size: ``burst``, or one second's worth."""
        return self.burst or max(1, int(self.messages_per_second))


class OnBacklog(BaseModel):
    """What to do when a target's queue (rows pending or waiting to retry) grows too long."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_rows: int = Field(ge=1, description="Queued rows allowed before the action.")
    action: Literal["alert", "pause"] = Field(
        "alert",
        description="alert: a warning in the log and a metric, delivery goes on; pause: the "
        "target is paused, as router pause does, until an operator resumes it.",
    )


class BrokerSettings(BaseModel):
    """Fields every broker kind has; each kind adds its connection and destination settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: str = Field(
        description="The kind of broker, which decides the settings it takes besides these."
    )
    internal: bool = Field(False, description="The owning system's own broker: gets every event.")
    envelope: Profile | None = Field(
        None,
        description="The envelope profile this broker receives; default: internal for the "
        "internal broker, external otherwise.",
    )
    omit: list[str] = Field(
        default_factory=list, description="Envelope fields to leave out for this broker."
    )
    expose: Expose | None = Field(
        None,
        description="Partners only: the staged headers, extensions, internal-only fields and "
        "payload fields this broker receives; default: no header, extension or field beyond "
        "the external envelope, and whole payloads.",
    )
    events: EventFilter | None = Field(
        None,
        description="External brokers only: which published event types to send; default: "
        "all of them.",
    )
    versions: dict[str, int] = Field(
        default_factory=dict,
        description="Partners only: event type -> the version this broker receives, older than "
        "the current one; the event's downcasters make it (Event.downcaster).",
    )
    destination: str = Field(
        "{destination}",
        description="Template for where each event goes on this broker: {event_type}, "
        "{destination}, {service} and {version} are replaced; the default is the destination "
        "the event declares, else its type.",
    )
    cloudevents_mode: Literal["structured", "binary"] = Field(
        "structured",
        description="With envelope: cloudevents, the whole event as the body (structured) or "
        "the data as the body and the attributes as headers (binary).",
    )
    rate_limit: RateLimit | None = Field(
        None,
        description="Messages per second to this target at most (a number, or "
        "{messages_per_second, burst}); default: as fast as the broker acknowledges.",
    )
    on_backlog: OnBacklog | None = Field(
        None,
        description="When this target's queue passes max_rows: alert (log and metric) or "
        "pause it (load shedding for a runaway backlog); default: no limit.",
    )
    ordering: Literal["skip", "hold", "park"] = Field(
        "skip",
        description="What becomes of a stream key whose head this broker refused for good, or "
        "that ran out of attempts: skip (it is abandoned, later rows of the key go on and the "
        "next one delivered names it), hold (the key waits, its later rows untried, until an "
        "operator runs router release) or park (the head and every later row of the key are "
        "set aside, parked, until router release puts them back in order). Rows without a "
        "stream key are abandoned whatever this says. A broker that is down or unreachable "
        "costs no attempt in any mode.",
    )
    atomic: bool = Field(
        False,
        description="Publish the rows of one application transaction for this target as one "
        "atomic unit: all stored or none, together (NATS JetStream: one atomic batch per "
        "stream, nats-server 2.12+; Azure Service Bus: one batch per entity; Redis: one Lua "
        "script on one node, which stores a unit sent again once, or MULTI/EXEC for a user "
        "without scripting). Never across targets. Kafka and RabbitMQ have no such unit and "
        "refuse it. A unit is what one database transaction staged: on PostgreSQL its xid; on "
        "MySQL/MariaDB and SQLite the transaction of the SQLAlchemy Session or Connection "
        "(sync or async), of Django's outermost atomic block, or of outbox.transaction(); a "
        "raw sqlite3 connection shows no transaction, so there each stage() call is a unit. "
        "stage() refuses, in the caller's transaction, rows that would make a unit larger "
        "than the broker's atomic write (JetStream and Redis 1,000 messages, Service Bus "
        "4,500).",
    )
    slo_seconds: float = Field(
        1.0,
        gt=0,
        description="Commit-to-acknowledgement time this target should meet, in seconds: "
        "status and /metrics report the share of rows delivered within it.",
    )
    connect_timeout: float = Field(5.0, gt=0, description="Seconds to wait for a connection.")
    publish_timeout: float = Field(
        10.0, gt=0, description="Seconds to wait for one batch's acknowledgements."
    )
    silence_timeout: float = Field(
        0.25,
        gt=0,
        description="Least time a publish may go unanswered before the connection is asked "
        "for a round trip (a ping), which must answer within as long again; the limit follows "
        "the broker's usual answer time above this. No answer: this host has lost its path to "
        "the broker, so it gives the batch back untried for other hosts and claims nothing "
        "until a probe gets through. A broker that answers the ping but acknowledges slowly "
        "gets the whole publish_timeout.",
    )

    @property
    def publish_limit(self) -> float:
        """The longest one publish call may take: connecting first, then every ack."""
        return self.connect_timeout + self.publish_timeout + 1

    @field_validator("destination")
    @classmethod
    def _known_placeholders(cls, template: str) -> str:
        try:
            names = {name for _, name, _, _ in string.Formatter().parse(template) if name}
        except ValueError as exc:
            raise ValueError(f"invalid template: {exc}") from exc
        unknown = names - PLACEHOLDERS
        if unknown:
            known = ", ".join("{" + n + "}" for n in sorted(PLACEHOLDERS))
            raise ValueError(f"unknown placeholder(s) {sorted(unknown)}; use {known}")
        return template

    @field_validator("expose")
    @classmethod
    def _expose_only_partners(cls, expose: Expose | None, info: ValidationInfo) -> Expose | None:
        # internal and envelope come before expose, so they are validated by now (unless
        # invalid: then their own error is reported, and this check has nothing to go on).
        if expose is None or "internal" not in info.data or "envelope" not in info.data:
            return expose
        if info.data["internal"]:
            raise ValueError("the internal broker gets everything; 'expose' is for partners")
        if info.data["envelope"] == "internal":
            raise ValueError(
                "envelope: internal sends everything; 'expose' is for the external and "
                "cloudevents envelopes"
            )
        if info.data["envelope"] == "cloudevents" and expose.fields:
            raise ValueError(
                "'fields' adds internal-only fields to the external body, and a cloudevents "
                "envelope has none; stage what this partner needs as an extension instead"
            )
        return expose

    @field_validator("versions")
    @classmethod
    def _pins(cls, versions: dict[str, int], info: ValidationInfo) -> dict[str, int]:
        if versions and info.data.get("internal"):
            raise ValueError("the internal broker gets every event as staged; pin partners only")
        for event_type, version in versions.items():
            if isinstance(version, bool) or version < 1:
                raise ValueError(f"{event_type}: a version is a positive integer")
        return versions

    @field_validator("omit")
    @classmethod
    def _omittable(cls, fields: list[str]) -> list[str]:
        unknown = set(fields) - _OMITTABLE - INTERNAL_ONLY_FIELDS
        if unknown:
            raise ValueError(f"cannot omit {sorted(unknown)}; omittable: {sorted(_OMITTABLE)}")
        return fields

    # The header prefix of the broker's CloudEvents binding, for binary mode.
    cloudevents_prefix: ClassVar[str] = "ce_"
    # Where each kind's adapter lives ("module:Class"), the pip extra that brings its client
    # library, and that library's modules: the adapter is imported only when a broker of its
    # kind opens, and a missing library is reported before anything starts.
    adapter: ClassVar[str] = ""
    extra: ClassVar[str | None] = None
    client_modules: ClassVar[tuple[str, ...]] = ()
    # How the partner contract (router contract export) names this kind: its product name
    # and AsyncAPI's protocol, with the protocol's version where it has several. Unset: the
    # kind's ``type``.
    title: ClassVar[str | None] = None
    asyncapi_protocol: ClassVar[str | None] = None
    asyncapi_protocol_version: ClassVar[str | None] = None
    # What a native property means where it differs by kind (the unit of ``timestamp``), by
    # property name; the contract describes the rest alike on every kind.
    property_descriptions: ClassVar[Mapping[str, str]] = {}
    # Why ``atomic: true`` is refused on this kind; None where its adapter has an atomic write
    # of several messages (``brokers.AtomicBroker``).
    no_atomic_unit: ClassVar[str | None] = "this kind of broker has no atomic write"
    # What ``atomic: true`` makes of a transaction's rows on this kind, for the partner
    # contract; None where it is refused.
    atomic_unit: ClassVar[str | None] = None
    # The most messages this kind's atomic write holds (None where it has none): stage()
    # refuses a transaction that would stage more for an atomic target. Its adapter keeps the
    # same figure (``max_unit``) without this import: stage() must not load a broker's SDK.
    max_unit: ClassVar[int | None] = None

    @model_validator(mode="after")
    def _filter_only_external(self) -> BrokerSettings:
        if self.internal and self.events is not None:
            raise ValueError("'events' filters external brokers; the internal broker gets all")
        return self

    @model_validator(mode="after")
    def _atomic_where_possible(self) -> BrokerSettings:
        if self.atomic and self.no_atomic_unit is not None:
            raise ValueError(f"atomic: true is not possible on {self.type}: {self.no_atomic_unit}")
        return self

    @property
    def binary_prefix(self) -> str | None:
        """The CloudEvents header prefix when this broker gets binary-mode CloudEvents."""
        if self.profile == "cloudevents" and self.cloudevents_mode == "binary":
            return self.cloudevents_prefix
        return None

    @cached_property
    def exposure(self) -> Exposure:
        """What this broker receives of each event, compiled once: everything on the internal
        broker or profile; otherwise what ``expose`` allows (by default nothing more than the
        external envelope)."""
        if self.internal or self.profile == "internal":
            return Exposure.EVERYTHING
        return (self.expose or Expose()).compile()

    @cached_property
    def _omitted(self) -> frozenset[str]:
        return frozenset(self.omit)  # render() takes a frozenset as it is

    def render(
        self, stored: str | bytes, *, sequence: int | None, skipped: Sequence[str] = ()
    ) -> WireMessage:
        """A stored envelope as this broker receives it: its profile, CloudEvents mode,
        allow-list and omissions; ``skipped``: the gap before it in its stream (message ids).
        What the processor publishes and ``router preview`` shows. Raises EnvelopeError for an
        envelope that cannot be rendered."""
        return render(
            stored,
            self.profile,
            sequence=sequence,
            skipped=skipped,
            omit=self._omitted,
            cloudevents_prefix=self.binary_prefix,
            exposure=self.exposure,
        )

    def native_headers(self, wire: WireMessage) -> dict[str, str]:
        """Every header ``wire`` carries on this broker: the rendered transport headers and
        those the adapter adds (``Nats-Msg-Id`` on NATS, say). A new dict, made from the
        rendered message alone: the adapter publishes exactly these."""
        return dict(wire.headers)

    def unit_headers(self) -> dict[str, bool]:
        """With ``atomic``: the headers each message of a transaction carries besides the
        rendered ones, by name, True where every message has it: the transaction's bounds
        (the relay's), and on some kinds the adapter's own."""
        if not self.atomic:
            return {}
        return {HeaderName.TRANSACTION_ID: True, HeaderName.TRANSACTION_SIZE: True}

    def location(self) -> dict[str, Any]:
        """Where this broker's messages go besides each destination, by name: what a
        consumer is bound to (the RabbitMQ exchange and virtual host, the JetStream stream,
        ...). Nothing for a kind whose destination says it all (Kafka's topic)."""
        return {}

    def delivery(self) -> dict[str, bool]:
        """How the router sends, where a partner can tell (RabbitMQ's ``persistent`` and
        ``mandatory``): the contract lock records it beside ``location``. Nothing by
        default."""
        return {}

    # The AsyncAPI document carries what ``location`` and ``delivery`` say as the protocol's
    # bindings where the spec has one (amqp, kafka) and as ``x-`` extensions where it has
    # none: a partner binds its consumer to them by name, so they belong in its contract.
    def channel_bindings(self, destination: str) -> dict[str, Any]:
        """The AsyncAPI channel's members that say where ``destination`` is consumed:
        ``bindings`` and ``x-`` extensions. Nothing by default."""
        return {}

    def operation_bindings(self) -> dict[str, Any]:
        """The AsyncAPI send operation's bindings, by protocol. Nothing by default."""
        return {}

    def message_bindings(self, event_type: str) -> dict[str, Any]:
        """The AsyncAPI message's bindings for ``event_type``, by protocol. Nothing by
        default."""
        return {}

    def template_problems(self) -> list[str]:
        """Why this broker would refuse every destination its template makes, told from
        these settings alone (``router check`` reports it before looking at any event).
        Nothing by default: a kind that can tell overrides it."""
        return []

    def native_properties(self, wire: WireMessage) -> NativeProperties:
        """The broker's own message properties ``wire`` carries besides its headers (AMQP
        properties, the Kafka record's key and timestamp, ...), named as the broker's
        ordinary client names them. A function of the rendered message and these settings
        alone (no publish time, no generated id, no library name), so the same stored row
        published again carries the same properties; the adapter publishes exactly these."""
        return {}

    @property
    def profile(self) -> Profile:
        """The envelope profile this broker receives."""
        if self.envelope is not None:
            return self.envelope
        return "internal" if self.internal else "external"

    def wants(self, event_type: str, *, published: bool) -> bool:
        """Whether an event of this type goes to this broker."""
        if self.internal:
            return True
        if not published:
            return False
        return self.events is None or self.events.matches(event_type)

    def destination_for(self, route: EventRoute) -> str:
        """Resolve the destination of one event; raises ValueError if the broker cannot take it."""
        destination = self.destination.format(**route.fields())
        self.check_destination(destination)
        return destination

    def check_destination(self, destination: str) -> None:
        """Raise ValueError when ``destination`` is not valid for this broker kind."""
        if not destination:
            raise ValueError("destination is empty")

    def refused_header(self, headers: Mapping[str, str]) -> tuple[str, str] | None:
        """The first staged header this broker would receive (what ``expose`` and ``omit``
        leave of ``headers``) but cannot carry, and why; None when it carries them all."""
        if not headers or "headers" in self._omitted:
            return None
        for name in self.exposure.staged_headers(headers):
            try:
                self.check_header_name(name)
            except ValueError as exc:
                return name, str(exc)
        return None

    def check_header_name(self, name: str) -> None:
        """Raise ValueError when this broker kind cannot carry a header called ``name``
        (Kafka and Service Bus carry any string)."""

    def public_url(self) -> str:
        """The broker's address with credentials removed, for logs and status output."""
        return ""

    def creates(self) -> str | None:
        """What connecting creates when it is missing (``"stream 'EVENTS'"``); None: nothing."""
        return None

    def without_creating(self) -> Self:
        """These settings with creating turned off, for checks that must change nothing."""
        return self

    def embedded_server(self, resolve: Callable[[str], Path]) -> EmbeddedServer | None:
        """The server the router runs for this broker, if any (``resolve`` makes config paths
        absolute)."""
        return None

    def missing_client(self) -> str | None:
        """What to install when this kind's client library is missing; None when it is there.

        Looks the modules up without importing them, so it costs microseconds.
        """
        missing = missing_modules(self.client_modules)
        return install_hint(self.type, self.extra, missing[0]) if missing else None


def redact_url(url: str) -> str:
    """Drop user, password and query secrets from a URL so it can be shown."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    if not parts.netloc:
        return url.partition("?")[0]
    host = parts.netloc.rpartition("@")[2]
    if "," not in host:  # several (postgresql://u:p@h1:5432,h2:5432/db) are shown as given
        host = parts.hostname or ""
        if parts.port:
            host = f"{host}:{parts.port}"
    if parts.username or parts.password:
        host = f"***@{host}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))
