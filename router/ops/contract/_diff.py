"""Comparing two contract locks: what a partner relying on the old one would notice.

At an unchanged event version the contract is exact: a partner may rely on every field being
there, of its type, with its values, in every message that had it. So these are breaking:

- an event version, envelope member or header no longer sent; a field removed or renamed;
- a type narrowed (number -> integer, a union losing a member, no longer nullable) or
  widened (integer -> number, a new union member: a reader written for the old type gets a
  value it does not expect), or changed;
- an enum value removed or added (a strict reader rejects an unknown one), a format,
  pattern or bound changed;
- optional made required, or required made optional (no longer in every message);
- a new required field (a payload field without a default, nullable or not) or envelope
  member: the messages already sent at this version (and stored rows replayed) lack it, so a
  partner validating with the new schema rejects them;
- a destination, content type, broker kind or envelope profile changed; a staged header or
  extension name pattern no longer allowed;
- a binding changed: the exchange (name, type, durability) or virtual host, the JetStream
  stream, the Redis database, the Service Bus entity kind or sessions: a partner's queue,
  consumer or receiver is bound to it by name, and would receive nothing more;
- RabbitMQ's ``persistent`` or ``mandatory`` turned off: messages a broker restart loses, or
  messages no queue takes dropped silently.

Additive (listed, not breaking): a new partner, event type, version, optional field (a
payload field with a default, None or not) or envelope member, header, or allowed header or
extension pattern; ``persistent`` or ``mandatory`` turned on; a default given to a payload
field (the exported schema no longer requires it, and the router still writes it). A new
version of an event type is a new contract beside the old one, never a change of it; titles,
descriptions and examples are documentation, not contract.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from router.ops.contract._lock import FIRST_FORMAT
from router.ops.contract._schema_diff import compare_schemas

__all__ = ["Change", "compare"]


@dataclass(frozen=True)
class Change:
    """One difference between the lock and the code, for one partner."""

    breaking: bool
    partner: str
    event_type: str | None
    version: int | None
    field: str  # "payload.total", "destination", "header stream-key", ... ("" for the event)
    what: str

    def line(self) -> str:
        """One line: kind, partner, event type and version, field, what changed."""
        event = f"{self.event_type} v{self.version}" if self.event_type else "every event"
        where = f"{self.field}: " if self.field else ""
        kind = "breaking" if self.breaking else "additive"
        return f"{kind}  {self.partner}  {event}  {where}{self.what}"

    def as_dict(self) -> dict[str, Any]:
        """For ``--json``."""
        return {
            "breaking": self.breaking,
            "partner": self.partner,
            "event_type": self.event_type,
            "version": self.version,
            "field": self.field,
            "change": self.what,
        }


_PARTNER_GONE = "no longer sent: nothing goes to this partner any more"
_EVENT_GONE = (
    "no longer sent (the event class is gone or unpublished, or the broker's events filter "
    "leaves it out)"
)


def compare(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Change]:
    """Every change from the ``old`` lock document to the ``new`` one, breaking first."""
    changes: list[Change] = []
    first_format = old.get("contract") == FIRST_FORMAT
    old_partners, new_partners = old.get("partners", {}), new.get("partners", {})
    for partner in sorted(old_partners.keys() | new_partners.keys()):
        before, after = old_partners.get(partner), new_partners.get(partner)
        if after is None:
            for event_type, version, _ in _entries(before):
                changes.append(Change(True, partner, event_type, version, "", _PARTNER_GONE))
        elif before is None:
            for event_type, version, _ in _entries(after):
                changes.append(Change(False, partner, event_type, version, "", "new partner"))
        else:
            changes.extend(_partner(partner, before, after, first_format=first_format))
    return sorted(changes, key=lambda c: not c.breaking)


def _entries(partner: Mapping[str, Any]) -> Iterator[tuple[str, int, Mapping[str, Any]]]:
    for event_type, versions in sorted(partner.get("events", {}).items()):
        for version, entry in sorted(versions.items(), key=lambda item: int(item[0])):
            yield event_type, int(version), entry


def _partner(
    name: str, before: Mapping[str, Any], after: Mapping[str, Any], *, first_format: bool
) -> list[Change]:
    changes = []
    for key in ("kind", "envelope"):
        if before.get(key) != after.get(key):
            what = f"{'broker kind' if key == 'kind' else 'envelope'} changed: "
            changes.append(Change(True, name, None, None, key, what + _pair(before, after, key)))
    if before.get("kind") == after.get("kind"):
        changes.extend(_binding(name, before, after))
    same_envelope = before.get("envelope") == after.get("envelope")
    old_events, new_events = before.get("events", {}), after.get("events", {})
    for event_type, version, entry in _entries(before):
        now = new_events.get(event_type, {}).get(str(version))
        if now is None:
            changes.append(Change(True, name, event_type, version, "", _EVENT_GONE))
            continue
        diff = _EntryDiff(name, event_type, version, _data(after), first_format)
        diff.entry(entry, now, same_envelope=same_envelope)
        changes.extend(diff.changes)
    for event_type, version, _ in _entries(after):
        if str(version) not in old_events.get(event_type, {}):
            what = "new version" if event_type in old_events else "new event type"
            changes.append(Change(False, name, event_type, version, "", what))
    return changes


def _binding(name: str, before: Mapping[str, Any], after: Mapping[str, Any]) -> list[Change]:
    """Where the partner consumes, besides each destination (an exchange, a stream...)."""
    new = _flat(after.get("binding", {}))
    if "binding" not in before:  # a lock written before bindings were recorded
        return [
            Change(False, name, None, None, f"binding.{key}", f"recorded: {value}")
            for key, value in new.items()
        ]
    old = _flat(before["binding"])
    changes = []
    for key in sorted(old.keys() | new.keys()):
        if key not in old:  # a lock written before this was recorded (persistent, mandatory)
            changes.append(
                Change(False, name, None, None, f"binding.{key}", f"recorded: {new[key]}")
            )
        elif old[key] != new.get(key):
            changes.append(_binding_change(name, key, old[key], new.get(key, "-")))
    return changes


# How a message is sent, by binding key: what a partner notices when it is turned off, and
# when it is turned on.
_DELIVERY = {
    "persistent": (
        "messages are no longer stored on disk: a broker restart loses those not yet consumed",
        "messages are now stored on disk",
    ),
    "mandatory": (
        "a message no queue is bound to is now dropped silently, not refused and retried",
        "a message no queue is bound to is now refused and retried, not dropped",
    ),
}


def _binding_change(name: str, key: str, old: Any, new: Any) -> Change:
    """A binding key changed: where a partner consumes (breaking), or how messages are sent
    (breaking when a guarantee is lost)."""
    changed = f"changed: {old} -> {new}; "
    if key in _DELIVERY:
        lost, gained = _DELIVERY[key]
        breaking = new is not True
        return Change(
            breaking, name, None, None, f"binding.{key}", changed + (lost if breaking else gained)
        )
    what = changed + "a partner bound to the old one receives nothing more"
    return Change(True, name, None, None, f"binding.{key}", what)


def _flat(binding: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"exchange": {"name": "x"}}`` -> ``{"exchange.name": "x"}``."""
    flat: dict[str, Any] = {}
    for key, value in binding.items():
        if isinstance(value, Mapping):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _pair(before: Mapping[str, Any], after: Mapping[str, Any], key: str) -> str:
    return f"{before.get(key)} -> {after.get(key)}"


def _data(partner: Mapping[str, Any]) -> str:
    """What a partner calls the payload: CloudEvents say data."""
    return "data" if str(partner.get("envelope", "")).startswith("cloudevents") else "payload"


@dataclass
class _EntryDiff:
    """The changes of one event version for one partner."""

    partner: str
    event_type: str
    version: int
    payload_name: str
    first_format: bool  # the old entry is from a lock of format 1
    changes: list[Change] = field(default_factory=list)

    def add(self, breaking: bool, where: str, what: str) -> None:
        self.changes.append(
            Change(breaking, self.partner, self.event_type, self.version, where, what)
        )

    def entry(self, old: Mapping[str, Any], new: Mapping[str, Any], *, same_envelope: bool) -> None:
        for key in ("destination", "content_type"):
            if old.get(key) != new.get(key) and (same_envelope or key == "destination"):
                self.add(True, key.replace("_", "-"), f"changed: {_pair(old, new, key)}")
        if same_envelope:
            self.envelope(old.get("envelope", {}), new.get("envelope", {}))
            self.headers(old.get("headers", {}), new.get("headers", {}))
        old_payload, new_payload = old.get("payload", {}), new.get("payload", {})
        compare_schemas(
            old_payload,
            new_payload,
            self.payload_name,
            self.add,
            old_lists_written=self.first_format,
        )

    def envelope(self, old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
        as_object = [
            {"type": "object", "properties": e.get("fields", {}), "required": e.get("required", [])}
            for e in (old, new)
        ]
        compare_schemas(as_object[0], as_object[1], "envelope", self.add)
        self.patterns(old, new, "extensions", "envelope.extensions", "extensions named")

    def headers(self, old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
        old_required, new_required = set(old.get("required", [])), set(new.get("required", []))
        old_all = old_required | set(old.get("optional", []))
        new_all = new_required | set(new.get("optional", []))
        for name in sorted(old_all | new_all):
            where = f"header {name}"
            if name not in new_all:
                self.add(True, where, "no longer sent")
            elif name not in old_all:
                self.add(False, where, "new header")
            elif name in old_required and name not in new_required:
                self.add(True, where, "required made optional (no longer in every message)")
            elif name in new_required and name not in old_required:
                self.add(True, where, "optional made required")
        old_values, new_values = old.get("values", {}), new.get("values", {})
        for name in sorted(old_values.keys() & new_all):
            if old_values[name] != new_values.get(name):
                value = new_values.get(name, "any value")
                self.add(True, f"header {name}", f"value changed: {old_values[name]} -> {value}")
        self.patterns(old, new, "staged", "headers", "staged headers named")

    def patterns(
        self, old: Mapping[str, Any], new: Mapping[str, Any], key: str, where: str, named: str
    ) -> None:
        before, after = set(old.get(key, [])), set(new.get(key, []))
        for glob in sorted(before - after):
            self.add(True, where, f"{named} {glob!r} no longer sent")
        for glob in sorted(after - before):
            self.add(False, where, f"{named} {glob!r} now sent")
