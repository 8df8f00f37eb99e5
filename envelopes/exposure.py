"""What a partner receives of an event beyond the external envelope: an allow-list.

A partner (a broker with the external or CloudEvents profile) gets the staged headers and
extensions whose names a glob allows, the internal-only fields it names, and, per event type,
only the payload fields it names; by default none of the first three and the whole payload.
The transport headers the router sets itself (``HeaderName``) are not staged headers: every
partner gets them. The internal profile carries everything and takes no allow-list.

An ``Exposure`` is compiled once per broker; per message it only filters dicts, with each
name's answer remembered (a bounded cache), so no glob is matched twice for one name.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from envelopes.metadata import METADATA_DEFAULTS
from envelopes.models import EXTERNAL_FIELDS, INTERNAL_ONLY_FIELDS

__all__ = ["EXPOSABLE_FIELDS", "Exposure"]

# Internal-only fields that never leave, whatever a broker's allow-list says:
# - sequence: the row's position in this target's outbox; it differs per target, means nothing
#   to a partner, and tells it how many events we write;
# - checksum: taken over the stored payload, it no longer matches a projected one, and a hash
#   of fields kept from a partner lets it confirm a guess at their values;
# - event_class: our Python module layout, nothing a partner can act on;
# - headers: the staged headers have their own allow-list by name (``expose.headers``), sent
#   as transport headers; a copy in the body would go around it;
# - skipped: the gap marker reaches every partner already, as the router's transport header
#   ``skipped-message-ids`` (``HeaderName.SKIPPED``) on every profile, CloudEvents' included
#   (where a body member would be no attribute of the event). It names only events of the
#   partner's own target, so it tells the partner nothing but that events it should have had
#   are missing, and which; one place to read it keeps the partner's body as its contract
#   says, whatever its profile. skipped_count likewise: the ``skipped-count`` header.
_NEVER_EXPOSED = frozenset(
    {"sequence", "skipped", "skipped_count", "checksum", "event_class", "headers"}
)
# The internal-only fields a partner's allow-list may add to the external body.
EXPOSABLE_FIELDS: frozenset[str] = INTERNAL_ONLY_FIELDS - _NEVER_EXPOSED

# Names remembered per allow-list. Header and extension names are chosen by the writers of
# events, not by config; past this many the memory is dropped and learnt again.
_REMEMBERED = 1024


class _Names:
    """Case-insensitive globs over names, with the answer for each name seen remembered."""

    __slots__ = ("_match", "_seen")

    def __init__(self, patterns: Iterable[str]) -> None:
        # One regex for all the globs: a name unseen so far costs one match, not one per glob.
        joined = "|".join(fnmatch.translate(p) for p in patterns)
        self._match = re.compile(joined, re.IGNORECASE).match if joined else None
        self._seen: dict[str, bool] = {}

    def keep(self, named: Mapping[str, Any]) -> dict[str, Any]:
        """The members of ``named`` whose names a glob allows."""
        if self._match is None:
            return {}
        seen = self._seen
        kept = {}
        for name, value in named.items():
            allowed = seen.get(name)
            if allowed is None:
                allowed = self._learn(name)
            if allowed:
                kept[name] = value
        return kept

    def _learn(self, name: str) -> bool:
        assert self._match is not None
        allowed = self._match(name) is not None
        if len(self._seen) >= _REMEMBERED:
            self._seen.clear()
        self._seen[name] = allowed
        return allowed


@dataclass(frozen=True, slots=True, eq=False)
class Exposure:
    """One partner's allow-list, compiled: what ``render`` lets through besides the external
    envelope (``Exposure()`` lets nothing through and keeps every payload whole)."""

    headers: tuple[str, ...] = ()  # globs on staged header names
    extensions: tuple[str, ...] = ()  # globs on extension names
    fields: frozenset[str] = frozenset()  # internal-only fields, from EXPOSABLE_FIELDS
    payload: Mapping[str, frozenset[str]] = field(default_factory=dict)  # type -> fields kept
    # (type, version) -> fields kept: one version's own projection, instead of its type's
    payload_versions: Mapping[tuple[str, int], frozenset[str]] = field(default_factory=dict)
    everything: bool = False  # no allow-list at all: today's internal broker on any profile
    body_fields: tuple[str, ...] = field(init=False, repr=False)
    _headers: _Names = field(init=False, repr=False)
    _extensions: _Names = field(init=False, repr=False)

    NOTHING: ClassVar[Exposure]
    EVERYTHING: ClassVar[Exposure]

    def __post_init__(self) -> None:
        refused = self.fields - EXPOSABLE_FIELDS
        if refused:
            raise ValueError(
                f"cannot expose {sorted(refused)}; exposable: {sorted(EXPOSABLE_FIELDS)}"
            )
        # The external body in a fixed order: the partner fields, the exposed ones in their
        # declaration order, the payload last.
        exposed = tuple(name for name in METADATA_DEFAULTS if name in self.fields)
        partner = tuple(name for name in EXTERNAL_FIELDS if name != "payload")
        object.__setattr__(self, "body_fields", (*partner, *exposed, "payload"))
        object.__setattr__(self, "_headers", _Names(self.headers))
        object.__setattr__(self, "_extensions", _Names(self.extensions))

    def staged_headers(self, headers: Mapping[str, Any]) -> Mapping[str, Any]:
        """The staged headers this partner receives, of ``headers`` (all of them when
        nothing is restricted)."""
        return headers if self.everything else self._headers.keep(headers)

    def restrict(self, envelope: dict[str, Any]) -> None:
        """Cut a parsed stored envelope down, in place, to the staged headers, extensions and
        payload fields this partner may receive (``body_fields`` picks the fields)."""
        if self.everything:
            return
        headers = envelope.get("headers")
        if headers:
            envelope["headers"] = self._headers.keep(headers)
        extensions = envelope.get("extensions")
        if extensions:
            envelope["extensions"] = self._extensions.keep(extensions)
        if self.payload or self.payload_versions:
            kept = self.kept(envelope["type"], envelope.get("version", 1))
            payload = envelope.get("payload")
            if kept is not None and isinstance(payload, dict):
                envelope["payload"] = {k: v for k, v in payload.items() if k in kept}

    def kept(self, event_type: str, version: int) -> frozenset[str] | None:
        """The payload fields kept of one event version; None: its whole payload."""
        if self.payload_versions:
            kept = self.payload_versions.get((event_type, version))
            if kept is not None:
                return kept
        return self.payload.get(event_type)


Exposure.NOTHING = Exposure()
Exposure.EVERYTHING = Exposure(everything=True)
