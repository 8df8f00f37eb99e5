"""``expose:``: what a partner broker receives besides the external envelope, as config.

Validated where it is written (each wrong entry names its YAML path); ``Expose.compile``
turns it into the ``envelopes.Exposure`` that ``render`` applies.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from envelopes import EXPOSABLE_FIELDS, EXTERNAL_FIELDS, INTERNAL_ONLY_FIELDS, Exposure

__all__ = ["Expose"]


def _glob(pattern: str) -> str:
    if not pattern:
        raise ValueError("an empty pattern matches no name")
    return pattern


def _exposable(name: str) -> str:
    if name in EXPOSABLE_FIELDS:
        return name
    if name in EXTERNAL_FIELDS:
        problem = f"{name!r} reaches partners anyway"
    elif name == "headers":
        problem = "staged headers are exposed by name, in 'expose.headers'"
    elif name in INTERNAL_ONLY_FIELDS:
        problem = f"{name!r} is the router's bookkeeping and never leaves"
    else:
        problem = f"unknown field {name!r}"
    raise ValueError(f"{problem}; 'fields' takes {', '.join(sorted(EXPOSABLE_FIELDS))}")


def _top_level(name: str) -> str:
    if not name:
        raise ValueError("a payload field name cannot be empty")
    if "." in name:
        raise ValueError(
            f"{name!r}: only top-level payload fields can be kept (a kept field keeps all of "
            "its contents)"
        )
    return name


def _projected(key: str) -> str:
    """An event type, or ``type@version`` for one version of it."""
    event_type, at, version = key.rpartition("@")
    if not at:
        return key
    if not event_type or not version.isdigit() or int(version) < 1:
        raise ValueError(
            f"{key!r}: name an event type, or one version of it as TYPE@VERSION "
            "(orders.order_placed@1)"
        )
    return key


def _split(key: str) -> tuple[str, int | None]:
    """``type@2`` -> (type, 2); ``type`` -> (type, None): a projection of every version."""
    event_type, at, version = key.rpartition("@")
    return (event_type, int(version)) if at else (key, None)


def _some_fields(names: list[str]) -> list[str]:
    if not names:
        raise ValueError(
            "an empty list would send this event type without a payload; list the fields to "
            "keep, leave the type out to send its whole payload, or keep it from this broker "
            "with 'events.exclude'"
        )
    return names


_Glob = Annotated[str, AfterValidator(_glob)]


class Expose(BaseModel):
    """What a partner receives besides the external envelope (default: nothing more)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    headers: list[_Glob] = Field(
        default_factory=list,
        description="Staged header names sent as transport headers (globs, any case).",
    )
    extensions: list[_Glob] = Field(
        default_factory=list, description="Extension names sent (globs, any case)."
    )
    fields: list[Annotated[str, AfterValidator(_exposable)]] = Field(
        default_factory=list, description="Internal-only fields added to the external body."
    )
    payload: dict[
        Annotated[str, AfterValidator(_projected)],
        Annotated[list[Annotated[str, AfterValidator(_top_level)]], AfterValidator(_some_fields)],
    ] = Field(
        default_factory=dict,
        description="Per event type, the top-level payload fields kept (types not listed "
        "keep their whole payload); TYPE@VERSION projects one version, instead of TYPE's "
        "list. A list must name only fields of every published version it applies to.",
    )

    def projections(self) -> dict[tuple[str, int | None], list[str]]:
        """``payload`` by (event type, version); version None: every version without its own."""
        return {_split(key): names for key, names in self.payload.items()}

    def compile(self) -> Exposure:
        """The allow-list as ``render`` applies it."""
        every: dict[str, frozenset[str]] = {}
        one: dict[tuple[str, int], frozenset[str]] = {}
        for (event_type, version), names in self.projections().items():
            if version is None:
                every[event_type] = frozenset(names)
            else:
                one[event_type, version] = frozenset(names)
        return Exposure(
            headers=tuple(self.headers),
            extensions=tuple(self.extensions),
            fields=frozenset(self.fields),
            payload=every,
            payload_versions=one,
        )
