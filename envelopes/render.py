"""Build the stored internal envelope, and render it per profile into a wire message.

The outbox stores one JSON document per row: the full internal envelope. At publish time the
processor renders it for the row's broker:

- ``internal``: the whole envelope plus ``sequence`` (the row's outbox position) and, after a
  gap in the row's stream, ``skipped`` (the message ids its target abandoned before it), no
  nulls;
- ``external``: only the fields partners need (``EXTERNAL_FIELDS``), no nulls, no empty maps;
- ``cloudevents``: CloudEvents 1.0 structured mode (``application/cloudevents+json``).

The two partner profiles also pass through the broker's allow-list (``envelopes.Exposure``):
staged headers and extensions by name, internal-only fields, payload fields per event type.

Every profile also yields transport headers, so a consumer can route or deduplicate without
parsing the body (and learn of a gap: ``skipped-message-ids``, on every profile). Brokers map
``WireMessage`` to their native metadata.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, Unpack

import orjson

from envelopes.errors import EnvelopeError
from envelopes.exposure import Exposure
from envelopes.metadata import (
    MAX_SKIPPED_NAMED,
    METADATA_DEFAULTS,
    EnvelopeMetadata,
    HeaderName,
    wire_of,
)

__all__ = [
    "PROFILES",
    "EnvelopeTemplate",
    "Profile",
    "WireMessage",
    "check_cloudevents_extensions",
    "format_time",
    "make_internal_envelope",
    "render",
]

Profile = Literal["internal", "external", "cloudevents"]
PROFILES: tuple[Profile, ...] = ("internal", "external", "cloudevents")

JSON = "application/json"
CLOUDEVENTS_JSON = "application/cloudevents+json"
_CE_EXTENSION = re.compile(r"^[a-z0-9]{1,20}$")
# Context attributes of CloudEvents 1.0, and the ones this renderer sets itself: an extension
# may take none of these names, whether or not the event at hand uses them.
_CE_RESERVED = frozenset(
    {
        "specversion",
        "id",
        "source",
        "type",
        "time",
        "subject",
        "datacontenttype",
        "dataschema",
        "data",
        "data_base64",
        "eventversion",
        "correlationid",
        "causationid",
        "traceparent",
        "tracestate",
    }
)


def check_cloudevents_extensions(extensions: Mapping[str, Any]) -> None:
    """Raise EnvelopeError unless every name can be a CloudEvents extension attribute."""
    for name in extensions:
        if not _CE_EXTENSION.match(name) or name in _CE_RESERVED:
            raise EnvelopeError(
                f"extension {name!r} is not a valid CloudEvents attribute name "
                "(1-20 lowercase letters or digits, and not a context attribute)"
            )


# Envelope fields that also travel as headers or CloudEvents attributes, from their Wire marks.
_HEADER_FIELDS: tuple[tuple[str, str], ...] = (
    (HeaderName.SOURCE, "source"),
    *((wire.header, name) for name, wire in wire_of().items() if wire.header),
)
_CLOUDEVENTS_ATTRIBUTES: tuple[tuple[str, str], ...] = tuple(
    (name, wire.cloudevents) for name, wire in wire_of().items() if wire.cloudevents
)


# Not frozen: a frozen dataclass sets each field through object.__setattr__, about 1 µs
# more per message on the processor's hot path. Nothing changes a WireMessage once made.
@dataclass(slots=True)
class WireMessage:
    """One rendered message: body bytes plus the metadata brokers map to native fields."""

    message_id: str
    event_type: str
    body: bytes
    content_type: str
    headers: dict[str, str] = field(default_factory=dict)
    stream_key: str | None = None
    correlation_id: str | None = None
    time: str | None = None
    """The event's time (``format_time``): brokers with a message timestamp carry it."""
    priority: int | None = None
    """The staged priority, where the rendered message carries it: brokers with a native
    priority carry it there too."""


# Metadata names given (as the keywords came) -> the fields an envelope so given may carry, in
# the envelope's order: those given and those present by default (``asynchronous``). Few
# sets of names occur (one, ``stream``, for most events), and a tuple of the names as given
# is the cheapest key to find them by: a frozenset and a set difference per envelope cost
# more than the lookup.
_VISITED: dict[tuple[str, ...], tuple[str, ...]] = {}


def _visited(given: tuple[str, ...]) -> tuple[str, ...]:
    """The fields ``_VISITED`` holds for ``given``; TypeError for a name no field has."""
    unknown = set(given) - METADATA_DEFAULTS.keys()
    if unknown:
        raise TypeError(f"make_internal_envelope() got unknown metadata {sorted(unknown)}")
    visited = tuple(
        name
        for name, default in METADATA_DEFAULTS.items()
        if name in given or (default is not None and default != {})
    )
    if len(_VISITED) < 256:
        _VISITED[given] = visited
    return visited


def format_time(moment: datetime) -> str:
    """ISO-8601 UTC with microseconds and a 'Z', the one time format on the wire."""
    if moment.tzinfo is not UTC:
        moment = moment.astimezone(UTC)
    # Once per staged event. orjson writes a datetime in C, the same text at a seventh of
    # isoformat()'s cost, but leaves out a fraction of zero; and it takes no subclass
    # (freezegun's, say). In UTC isoformat() ends in +00:00, which the wire writes as Z.
    if moment.microsecond and type(moment) is datetime:
        return orjson.dumps(moment, option=orjson.OPT_UTC_Z)[1:-1].decode()
    return moment.replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"


def make_internal_envelope(
    *,
    message_id: str,
    event_type: str,
    version: int,
    time: datetime,
    source: str,
    payload_json: bytes,
    event_class: str | None = None,
    **metadata: Unpack[EnvelopeMetadata],
) -> bytes:
    """Serialise the full internal envelope around an already-serialised JSON payload.

    ``metadata`` takes the fields of ``envelopes.Metadata`` (each optional).
    """
    names = tuple(metadata)
    visited = _VISITED.get(names) or _visited(names)
    document: dict[str, Any] = {
        "id": message_id,
        "type": event_type,
        "version": version,
        "time": format_time(time),
        "source": source,
    }
    # Stored without nulls and empty maps (an absent field is null): the row is smaller, and
    # such an envelope is already the internal profile's body but for the sequence. Only the
    # fields given or present by default are visited (most events give one or two).
    given: Mapping[str, Any] = metadata
    for name in visited:
        value = given.get(name, METADATA_DEFAULTS[name])
        # Text and booleans, most fields, are kept as they are: neither is None, {}, a map.
        if type(value) is str or type(value) is bool:
            document[name] = value
        elif _present(value):
            document[name] = dict(value) if isinstance(value, Mapping) else value
    document["checksum"] = "sha256:" + hashlib.sha256(payload_json).hexdigest()
    if event_class is not None:
        document["event_class"] = event_class
    # The payload was serialised once by its pydantic model; embed those bytes as they are.
    document["payload"] = orjson.Fragment(payload_json)
    try:
        return orjson.dumps(document)
    except TypeError as exc:
        raise EnvelopeError(
            f"event {event_type!r}: envelope is not JSON-serialisable: {exc}"
        ) from exc


# Stand-ins for the values an ``EnvelopeTemplate`` fills in: private-use characters, which
# orjson writes as they are and which no configured name holds (the template checks that each
# stands once in what it was cut from). All but the stream's are cut out without their quotes,
# which stay in the template's parts.
_ID, _TIME, _SUM = ("\ue000id\ue000", "\ue000time\ue000", "\ue000sum\ue000")
_STREAM = orjson.dumps("\ue000stream\ue000")
_PAYLOAD = b'"\xee\x80\x80payload\xee\x80\x80"'
# Any time with a fraction of a second: the template replaces its text.
_TEMPLATE_TIME = datetime(2001, 2, 3, 4, 5, 6, 789012, tzinfo=UTC)


def _once(made: bytes, text: bytes, event_type: str) -> None:
    """EnvelopeError unless ``text`` stands once in ``made`` (a name holding it, or a
    stand-in, leaves no way to cut the envelope: such events take the general way)."""
    if made.count(text) != 1:
        raise EnvelopeError(f"event {event_type!r}: no envelope template for it")


class EnvelopeTemplate:
    """``make_internal_envelope`` for the events of one class staged with a stream key or
    none and no other metadata, most of them: the same bytes, from parts made once.

    ``stage()``'s own work on its common call is a few microseconds in a tight loop, but in
    a loop of commits it runs with cold caches at several times that, and its many small
    calls and frames are what the application pays on top of a hand-written outbox (#39):
    the envelope's dict, the walk over its metadata and orjson's serialisation of it are
    one join here. Cut from ``make_internal_envelope``'s own output, so the two agree by
    construction; ``tests/unit/test_envelope_template.py`` compares them too. EnvelopeError
    when the names leave no way to cut it (one holding the template's time, say).
    """

    __slots__ = ("_keyed", "_unkeyed")

    def __init__(self, *, event_type: str, version: int, source: str, event_class: str) -> None:
        def cut(stream: str | None) -> tuple[bytes, bytes, bytes, bytes, bytes, bytes]:
            made = make_internal_envelope(
                message_id=_ID,
                event_type=event_type,
                version=version,
                time=_TEMPLATE_TIME,
                source=source,
                payload_json=_PAYLOAD,
                stream=stream,
                event_class=event_class,
            )
            # The time and the checksum are made inside: their texts stand for them.
            moment = format_time(_TEMPLATE_TIME).encode()
            checksum = b"sha256:" + hashlib.sha256(_PAYLOAD).hexdigest().encode()
            for text, stand_in in ((moment, _TIME), (checksum, _SUM)):
                _once(made, text, event_type)
                made = made.replace(text, stand_in.encode())
            parts: list[bytes] = []
            for mark in (_ID.encode(), _TIME.encode(), _STREAM, _SUM.encode(), _PAYLOAD):
                if stream is None and mark == _STREAM:  # no stream: nothing between
                    parts.append(b"")
                    continue
                _once(made, mark, event_type)
                before, _, made = made.partition(mark)
                parts.append(before)
            a, b, c, d, e = parts
            return a, b, c, d, e, made

        self._keyed = cut(_STREAM.decode()[1:-1])
        self._unkeyed = cut(None)

    def make(
        self, message_id: str, time: datetime, stream: str | None, payload_json: bytes
    ) -> bytes:
        """``make_internal_envelope(message_id=..., time=..., payload_json=...,
        stream=stream)`` with this template's type, version, source and class."""
        a, b, c, d, e, f = self._unkeyed if stream is None else self._keyed
        return b"".join(
            (
                a,
                message_id.encode(),
                b,
                format_time(time).encode(),
                c,
                b"" if stream is None else orjson.dumps(stream),
                d,
                b"sha256:",
                hashlib.sha256(payload_json).hexdigest().encode(),
                e,
                payload_json,
                f,
            )
        )


def render(
    stored: bytes | str,
    profile: Profile,
    *,
    sequence: int | None = None,
    skipped: Sequence[str] = (),
    omit: Iterable[str] = (),
    cloudevents_prefix: str | None = None,
    exposure: Exposure = Exposure.NOTHING,
) -> WireMessage:
    """Render a stored internal envelope for one broker profile.

    The partner profiles send only what ``exposure`` allows of the staged headers, the
    extensions, the internal-only fields and the payload (by default: no staged header, no
    extension, no internal-only field, the whole payload); ``omit`` applies after it. The
    internal profile sends everything and ignores ``exposure``.

    ``skipped``: the message ids of the gap before this row in its stream (rows its target
    abandoned), oldest first: the ``skipped-message-ids`` header on every profile, and the
    ``skipped`` field of the internal profile's body (unless omitted). Empty: neither. Past
    ``MAX_SKIPPED_NAMED`` ids both name the oldest that many, and ``skipped-count`` (header)
    and ``skipped_count`` (internal body) say how many the gap held.

    With ``profile="cloudevents"`` and a ``cloudevents_prefix``, the event goes in binary
    mode: the body is the data alone and every other attribute becomes a header named with
    the broker binding's prefix (``ce_`` for Kafka, ``cloudEvents:`` for AMQP, ``ce-`` for
    NATS), but for ``datacontenttype``, which the bindings map to the message's content type
    (``content_type``, the ``content-type`` header); without a prefix it goes in structured
    mode, the whole event as the body.
    """
    try:
        envelope = orjson.loads(stored)
    except orjson.JSONDecodeError as exc:
        raise EnvelopeError(f"stored envelope is not valid JSON: {exc}") from exc
    if not isinstance(envelope, dict) or "id" not in envelope or "type" not in envelope:
        raise EnvelopeError("stored envelope has no 'id' or 'type'")
    omitted = omit if isinstance(omit, frozenset) else frozenset(omit)
    gap = _Gap.of(skipped)
    if profile == "internal" and not omitted and _is_compact(envelope):
        body, content_type = _with_sequence(stored, sequence, gap), JSON
    elif profile == "internal":
        envelope["sequence"] = sequence
        envelope["skipped"] = list(gap.named) if gap.named else None
        envelope["skipped_count"] = gap.cut
        # _kept inlined: this runs once per message on the processor's hot path.
        body_fields = {
            k: v
            for k, v in envelope.items()
            if ((v is not None and v != {}) or k == "payload") and k not in omitted
        }
        body, content_type = orjson.dumps(body_fields), JSON
    elif profile == "external":
        exposure.restrict(envelope)
        # _kept inlined, and the absent fields skipped by one lookup: this runs once per
        # message on the processor's hot path (it was a third of a partner's render).
        get = envelope.get
        body_fields = {}
        for k in exposure.body_fields:
            v = get(k)
            if ((v is not None and v != {}) or k == "payload") and k not in omitted:
                body_fields[k] = v
        body, content_type = orjson.dumps(body_fields), JSON
    elif profile == "cloudevents" and cloudevents_prefix is not None:
        exposure.restrict(envelope)
        event = _cloudevent(envelope, omitted)
        body, content_type = orjson.dumps(event.pop("data")), JSON
        # The bindings (Kafka, AMQP, NATS) map datacontenttype to the message's own content
        # type, which the content-type header and property carry: no prefixed copy of it.
        del event["datacontenttype"]
        headers = _headers(envelope, content_type, omitted, gap)
        headers.update(
            {cloudevents_prefix + name: _attribute(value) for name, value in event.items()}
        )
        return _wire(envelope, body, content_type, headers)
    elif profile == "cloudevents":
        exposure.restrict(envelope)
        body, content_type = orjson.dumps(_cloudevent(envelope, omitted)), CLOUDEVENTS_JSON
    else:  # pragma: no cover - Literal guards this for typed callers
        raise EnvelopeError(f"unknown envelope profile {profile!r}")
    wire = _wire(envelope, body, content_type, _headers(envelope, content_type, omitted, gap))
    if (
        profile != "cloudevents"
        and "priority" not in omitted
        and (profile == "internal" or "priority" in exposure.fields)
    ):
        wire.priority = envelope.get("priority")  # the body carries it, so may the broker
    return wire


def _is_compact(envelope: dict[str, Any]) -> bool:
    """True when the stored envelope has no nulls or empty maps, and no sequence or gap of its
    own: as ``make_internal_envelope`` writes it (rows written by earlier versions kept
    nulls)."""
    if "sequence" in envelope or "skipped" in envelope or "skipped_count" in envelope:
        return False
    for key, value in envelope.items():
        if (value is None or value == {}) and key != "payload":
            return False
    return True


@dataclass(frozen=True, slots=True)
class _Gap:
    """What a message says of the gap before it: the ids it names (the oldest
    ``MAX_SKIPPED_NAMED``), and how many the gap held when that is more (else None)."""

    named: Sequence[str]
    cut: int | None

    @classmethod
    def of(cls, skipped: Sequence[str]) -> _Gap:
        if not skipped:  # nearly every message: no object made on the relay's hot path
            return _NO_GAP
        if len(skipped) <= MAX_SKIPPED_NAMED:
            return cls(skipped, None)
        return cls(skipped[:MAX_SKIPPED_NAMED], len(skipped))


_NO_GAP = _Gap((), None)


def _with_sequence(stored: bytes | str, sequence: int | None, gap: _Gap) -> bytes:
    """The stored document as it is, with ``sequence`` and the gap (``skipped`` and
    ``skipped_count``, when there are any) as its last members: the bytes are spliced rather
    than parsed and dumped again, which is most of what rendering costs (and the payload goes
    out byte for byte as its checksum was taken)."""
    raw = (stored.encode() if isinstance(stored, str) else stored).rstrip()
    # It parsed as an object with members, so it ends with "}". One format each way: the
    # document is copied once.
    if not gap.named:
        return raw if sequence is None else b'%s,"sequence":%d}' % (raw[:-1], sequence)
    named = orjson.dumps(list(gap.named))
    if gap.cut is not None:
        named += b',"skipped_count":%d' % gap.cut
    if sequence is None:
        return b'%s,"skipped":%s}' % (raw[:-1], named)
    return b'%s,"sequence":%d,"skipped":%s}' % (raw[:-1], sequence, named)


def _wire(
    envelope: dict[str, Any], body: bytes, content_type: str, headers: dict[str, str]
) -> WireMessage:
    return WireMessage(
        message_id=envelope["id"],
        event_type=envelope["type"],
        body=body,
        content_type=content_type,
        headers=headers,
        stream_key=envelope.get("stream"),
        correlation_id=envelope.get("correlation_id"),
        time=envelope.get("time"),
    )


def _attribute(value: Any) -> str:
    """A CloudEvents attribute as a header value (binary mode carries strings)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    return orjson.dumps(value).decode()


def _kept(name: str, value: Any) -> bool:
    """No nulls and no empty maps at the top level; but the payload always, even ``{}``."""
    return name == "payload" or _present(value)


def _present(value: Any) -> bool:
    return value is not None and value != {}


def _cloudevent(envelope: dict[str, Any], omitted: frozenset[str]) -> dict[str, Any]:
    event: dict[str, Any] = {
        "specversion": "1.0",
        "id": envelope["id"],
        "source": envelope["source"],
        "type": envelope["type"],
        "time": envelope["time"],
        "datacontenttype": JSON,
        "eventversion": envelope.get("version", 1),
    }
    for field_name, attribute in _CLOUDEVENTS_ATTRIBUTES:
        value = envelope.get(field_name)
        if value is not None and field_name not in omitted:
            event[attribute] = value
    if "extensions" not in omitted:
        extensions = envelope.get("extensions") or {}
        check_cloudevents_extensions(extensions)
        event.update(extensions)
    event["data"] = envelope["payload"]
    return event


def _headers(
    envelope: dict[str, Any], content_type: str, omitted: frozenset[str], gap: _Gap
) -> dict[str, str]:
    headers: dict[str, str] = {}
    if "headers" not in omitted:
        headers.update(envelope.get("headers") or {})
        # The router's gap marker, never a staged header's: a message after no gap has none.
        headers.pop(HeaderName.SKIPPED, None)
        headers.pop(HeaderName.SKIPPED_COUNT, None)
    get = envelope.get
    headers[HeaderName.MESSAGE_ID] = envelope["id"]
    headers[HeaderName.EVENT_TYPE] = envelope["type"]
    headers[HeaderName.EVENT_VERSION] = str(get("version", 1))
    for name, field_name in _HEADER_FIELDS:
        value = get(field_name)
        if value is not None and (field_name == "source" or field_name not in omitted):
            headers[name] = value
    headers[HeaderName.CONTENT_TYPE] = content_type
    if gap.named and "skipped" not in omitted:
        headers[HeaderName.SKIPPED] = ",".join(gap.named)
        if gap.cut is not None:
            headers[HeaderName.SKIPPED_COUNT] = str(gap.cut)
    return headers
