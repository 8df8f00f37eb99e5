"""What each partner receives of each event version: found by staging and rendering samples.

Which partners get an event and where is what staging resolves (``Stager.build_rows``:
``BrokerSettings.wants`` and ``destination_for``); which version a partner gets, and which
envelope members and headers, is what the processor publishes (``router.write.pinning.Received``:
downcast for a broker's ``versions:``, then rendered), with the headers and native properties
the adapter adds (``native_headers``, ``native_properties``), read off two samples: one with
every metadata field set and a gap before it in its stream (what may be sent), one with none
(what is always sent). Nothing here
restates those rules, so the contract cannot drift from the wire. Staged headers and
extensions are allowed by name globs (``expose.headers``, ``expose.extensions``) and are
described by those globs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

from brokers import BrokerSettings
from envelopes import (
    MAX_SKIPPED_NAMED,
    ConfigError,
    DowncastError,
    Metadata,
    StageOptions,
    StagingError,
    WireMessage,
)
from router.config import RouterConfig
from router.ops.contract._members import (
    EXTENSIONS,
    STAGED,
    attribute_schemas,
    field_schemas,
    fixed_values,
    header_schema,
    named_object,
    property_schema,
)
from router.ops.contract._schema import Schema, payload_schema, project
from router.ops.preview import example_of
from router.write.catalog import EventCatalog, check_partners
from router.write.events import Event, EventSpec
from router.write.pinning import Received, check_pin
from router.write.staging import Row, Stager

__all__ = ["Member", "PartnerMessage", "partner_messages"]

_SAMPLE_STREAM = "stream-1"
# The wide sample's gap: rows of its stream abandoned before it (``skipped``), more than a
# message names, so that the sample carries the count's header too.
SAMPLE_SKIPPED = ("01890a5d-ac96-774b-bcce-b302099a8056",) * (MAX_SKIPPED_NAMED + 1)


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
    headers: tuple[Member, ...]  # every header on the wire: transport headers, adapter's own
    properties: tuple[Member, ...]  # the broker's own message properties (AMQP, Kafka, ...)
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
    """Every (partner, event type, version received) that some database publishes, sorted.
    Internal brokers are left out: what they get is no partner's contract. Raises
    ConfigError for what ``router serve`` refuses (``check_partners``) and when an event
    cannot be staged for a partner (its destination, say)."""
    check_partners(config, catalog)
    stager = Stager(config)
    found: dict[tuple[str, str, int], PartnerMessage] = {}
    for event_class in catalog:
        spec = event_class.__event__
        for database in config.databases:
            brokers = config.brokers_of(database)
            partners = [
                name
                for name, broker in brokers.items()
                if not broker.internal and broker.wants(spec.type, published=spec.published)
            ]
            if not partners or not _stageable(brokers, spec):
                continue
            wide, bare = _sample_rows(stager, database, event_class)
            for name in partners:
                received = config.brokers[name].versions.get(spec.type, spec.version)
                key = (name, spec.type, received)
                if key not in found and name in wide:
                    as_received = catalog.get(spec.type, received)
                    found[key] = _message(config, name, as_received, wide[name], bare[name])
    return [found[key] for key in sorted(found)]


def _stageable(brokers: Mapping[str, BrokerSettings], spec: EventSpec) -> bool:
    """False when staging refuses this version because a broker is pinned to a newer one
    (events are downcast, never upcast): an older class kept as another partner's pin."""
    for name, broker in brokers.items():
        pinned = broker.versions.get(spec.type)
        wanted = broker.wants(spec.type, published=spec.published)
        if wanted and pinned is not None and pinned != spec.version:
            try:
                check_pin(spec, name, pinned)
            except StagingError:
                return False
    return True


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


def _render(settings: BrokerSettings, stored: str, skipped: tuple[str, ...] = ()) -> WireMessage:
    """As the processor publishes a row to this broker (``Received``: downcast to a pinned
    version, then rendered), after the gap ``skipped`` in its stream."""
    try:
        return Received(settings)(stored, sequence=1, skipped=skipped)
    except DowncastError as exc:  # the user's downcaster: any error is theirs to see
        raise ConfigError(f"cannot downcast an example event for a pinned partner: {exc}") from exc


def _message(
    config: RouterConfig, name: str, event_class: type[Event], wide_row: Row, bare_row: Row
) -> PartnerMessage:
    settings = config.brokers[name]
    spec = event_class.__event__
    wide = _render(settings, wide_row.envelope, SAMPLE_SKIPPED)
    bare = _render(settings, bare_row.envelope)
    omitted = frozenset(settings.omit)
    everything = settings.exposure.everything
    staged = () if "headers" in omitted else ("*",) if everything else settings.exposure.headers
    extensions = (
        () if "extensions" in omitted else ("*",) if everything else settings.exposure.extensions
    )
    fixed = fixed_values(spec.type, spec.version, config.service, wide.content_type)
    binary = settings.binary_prefix is not None
    payload_member = None if binary else "data" if settings.profile == "cloudevents" else "payload"
    envelope: tuple[Member, ...] = ()
    if payload_member is not None:
        cloudevents = settings.profile == "cloudevents"
        schemas = attribute_schemas(fixed) if cloudevents else field_schemas(fixed)
        sent, always = json.loads(wide.body), json.loads(bare.body)
        envelope = tuple(
            Member(key, key in always, schemas.get(key, {}))
            for key in sent
            if key != payload_member
        )
        envelope += _allow_listed_members(settings.profile, staged, extensions)
    on_wire, always = settings.native_headers(wide), settings.native_headers(bare)
    headers = tuple(
        Member(header, header in always, header_schema(header, settings, fixed))
        for header in on_wire
    ) + tuple(
        Member(header, every, header_schema(header, settings, fixed))
        for header, every in settings.unit_headers().items()
    )
    bare_properties = settings.native_properties(bare)
    properties = tuple(
        Member(name, name in bare_properties, property_schema(settings, name, value, fixed))
        for name, value in settings.native_properties(wide).items()
    )
    kept = settings.exposure.kept(spec.type, spec.version)
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
        properties=properties,
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
        members.append(Member("extensions", False, named_object(extensions, EXTENSIONS)))
    if staged and profile == "internal":
        members.append(Member("headers", False, named_object(staged, STAGED, string=True)))
    return tuple(members)
