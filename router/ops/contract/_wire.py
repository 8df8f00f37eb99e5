"""What each partner receives of each event version: found by staging and rendering samples.

Which partners get an event and where is what staging resolves (``Stager.build_rows``:
``BrokerSettings.wants`` and ``destination_for``); which envelope members and headers they
get is what ``envelopes.render`` sends with the broker's profile, ``omit`` and ``expose``,
read off two rendered samples: one with every metadata field set (what may be sent), one
with none (what is always sent). Nothing here restates those rules, so the contract cannot
drift from the wire. Staged headers and extensions are allowed by name globs
(``expose.headers``, ``expose.extensions``) and are described by those globs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from brokers import BrokerSettings
from envelopes import (
    ConfigError,
    HeaderName,
    InternalEnvelope,
    Metadata,
    StageOptions,
    StagingError,
    WireMessage,
    render,
)
from envelopes.metadata import wire_of
from router.config import RouterConfig
from router.ops.contract._schema import (
    Schema,
    glob_pattern,
    payload_schema,
    project,
    without_null,
)
from router.ops.preview import example_of
from router.write.catalog import EventCatalog
from router.write.events import Event
from router.write.staging import Row, Stager

__all__ = ["Member", "PartnerMessage", "partner_messages"]

_SAMPLE_STREAM = "stream-1"


@dataclass(frozen=True)
class Member:
    """A named part of a message besides the payload: an envelope member or a header."""

    name: str
    required: bool  # in every message; otherwise only when set (and never null)
    schema: Schema


@dataclass(frozen=True)
class PartnerMessage:
    """What one partner receives for one version of one event type."""

    partner: str
    settings: BrokerSettings
    event_class: type[Event]
    destination: str
    content_type: str
    envelope: tuple[Member, ...]  # body members besides the payload (none in binary mode)
    payload_member: str | None  # the body member holding the payload; None: it is the body
    payload: Schema  # the event's JSON schema after the partner's projection, with $defs
    headers: tuple[Member, ...]  # the transport headers the router sets
    staged_headers: tuple[str, ...]  # globs: the staged headers sent as transport headers
    extensions: tuple[str, ...]  # globs: the extensions sent

    @property
    def event_type(self) -> str:
        """The event type name."""
        return self.event_class.__event__.type

    @property
    def version(self) -> int:
        """The event type's version."""
        return self.event_class.__event__.version

    @property
    def profile(self) -> str:
        """external, cloudevents, cloudevents-binary (attributes as headers) or internal."""
        binary = self.settings.binary_prefix is not None
        return "cloudevents-binary" if binary else self.settings.profile


def partner_messages(config: RouterConfig, catalog: EventCatalog) -> list[PartnerMessage]:
    """Every (partner, event type, version) that some database publishes, sorted. Internal
    brokers are left out: what they get is no partner's contract. Raises ConfigError when an
    event cannot be staged for a partner (its destination, say)."""
    stager = Stager(config)
    found: dict[tuple[str, str, int], PartnerMessage] = {}
    for event_class in catalog:
        spec = event_class.__event__
        for database in config.databases:
            partners = [
                name
                for name, broker in config.brokers_of(database).items()
                if not broker.internal
                and broker.wants(spec.type, published=spec.published)
                and (name, spec.type, spec.version) not in found
            ]
            if not partners:
                continue
            wide, bare = _sample_rows(stager, database, event_class)
            for name in partners:
                if name in wide:
                    message = _message(config, name, event_class, wide[name], bare[name])
                    found[(name, spec.type, spec.version)] = message
    return [found[key] for key in sorted(found)]


def _sample_rows(
    stager: Stager, database: str, event_class: type[Event]
) -> tuple[dict[str, Row], dict[str, Row]]:
    """The rows of a sample event by target: with every metadata field set, and with none."""
    event = _sample_event(event_class)
    metadata = example_of(Metadata).model_dump(exclude={"stream", "headers", "extensions"})
    try:
        wide = stager.build_rows(
            database, [event], stream_key=_SAMPLE_STREAM, **cast(StageOptions, metadata)
        )
        bare = stager.build_rows(database, [event])
    except StagingError as exc:
        raise ConfigError(f"databases.{database}: {exc}") from None
    return {r.target: r for r in wide}, {r.target: r for r in bare}


def _sample_event(event_class: type[Event]) -> Event:
    # Only the envelope around it is read, so an event the example maker cannot fill in
    # (a field of a type it does not know) is made without its fields.
    try:
        return example_of(event_class)
    except Exception:
        return event_class.model_construct()


def _render(settings: BrokerSettings, stored: str) -> WireMessage:
    """As the processor renders a row for this broker (``router.relay.delivery``)."""
    return render(
        stored,
        settings.profile,
        sequence=1,
        omit=frozenset(settings.omit),
        cloudevents_prefix=settings.binary_prefix,
        exposure=settings.exposure,
    )


def _message(
    config: RouterConfig, name: str, event_class: type[Event], wide_row: Row, bare_row: Row
) -> PartnerMessage:
    settings = config.brokers[name]
    spec = event_class.__event__
    wide, bare = _render(settings, wide_row.envelope), _render(settings, bare_row.envelope)
    omitted = frozenset(settings.omit)
    everything = settings.exposure.everything
    staged = () if "headers" in omitted else ("*",) if everything else settings.exposure.headers
    extensions = (
        () if "extensions" in omitted else ("*",) if everything else settings.exposure.extensions
    )
    fixed = _fixed_values(spec.type, spec.version, config.service, wide.content_type)
    binary = settings.binary_prefix is not None
    payload_member = None if binary else "data" if settings.profile == "cloudevents" else "payload"
    envelope: tuple[Member, ...] = ()
    if payload_member is not None:
        cloudevents = settings.profile == "cloudevents"
        schemas = _attribute_schemas(fixed) if cloudevents else _field_schemas(fixed)
        sent, always = json.loads(wide.body), json.loads(bare.body)
        envelope = tuple(
            Member(key, key in always, schemas.get(key, {}))
            for key in sent
            if key != payload_member
        )
        envelope += _allow_listed_members(settings.profile, staged, extensions)
    headers = tuple(
        Member(header, header in bare.headers, _header_schema(header, settings, fixed))
        for header in wide.headers
    )
    kept = settings.exposure.payload.get(spec.type)
    return PartnerMessage(
        partner=name,
        settings=settings,
        event_class=event_class,
        destination=wide_row.destination,
        content_type=wide.content_type,
        envelope=envelope,
        payload_member=payload_member,
        payload=project(payload_schema(event_class), kept),
        headers=headers,
        staged_headers=tuple(staged),
        extensions=tuple(extensions),
    )


def _allow_listed_members(
    profile: str, staged: tuple[str, ...], extensions: tuple[str, ...]
) -> tuple[Member, ...]:
    """The body members that the samples leave empty: extensions (and on the internal
    profile, the staged headers) exist when an allow-list lets names through."""
    members = []
    if extensions and profile != "cloudevents":  # CloudEvents: top-level attributes instead
        members.append(Member("extensions", False, named_object(extensions, _EXTENSIONS)))
    if staged and profile == "internal":
        members.append(Member("headers", False, named_object(staged, _STAGED, string=True)))
    return tuple(members)


_EXTENSIONS = "Extension attributes staged with the event, by name (expose.extensions)."
_STAGED = "Headers staged with the event, by name (expose.headers)."


def named_object(globs: tuple[str, ...], description: str, *, string: bool = False) -> Schema:
    """An object whose member names match case-insensitive ``globs``."""
    value: Schema = {"type": "string"} if string else {}
    return {
        "type": "object",
        "description": f"{description} Names: {', '.join(globs)} (any case).",
        "patternProperties": {glob_pattern(glob): dict(value) for glob in globs},
    }


# --- schemas of the members -------------------------------------------------------------------


def _fixed_values(event_type: str, version: int, service: str, content_type: str) -> dict[str, Any]:
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


def _field_schemas(fixed: Mapping[str, Any]) -> dict[str, Schema]:
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


def _attribute_schemas(fixed: Mapping[str, Any]) -> dict[str, Schema]:
    """The CloudEvents attributes: the identity and metadata fields they carry, named as
    their ``Wire`` marks say, and the attributes of CloudEvents itself."""
    fields = _field_schemas(fixed)
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
}


def _header_schema(header: str, settings: BrokerSettings, fixed: Mapping[str, Any]) -> Schema:
    """A transport header's schema (every header value is a string)."""
    prefix = settings.binary_prefix
    if prefix and header.startswith(prefix):
        attribute = _attribute_schemas(fixed).get(header.removeprefix(prefix), {})
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
