"""The event classes a service declares, found through the config's ``events:`` modules.

Staging needs no catalog: it gets event instances. The router process does, to check what a
config says about events (a partner's payload projection, a pinned version) and to show
what a partner receives (``router preview``, ``router contract``): it imports the modules
the config names and keeps every ``Event`` subclass they define or import, by type and
version.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from brokers import BrokerSettings
from envelopes import ConfigError
from router.config import RouterConfig
from router.errors import ConfigDeprecationWarning
from router.write.events import Event
from router.write.pinning import check_pins

__all__ = ["EventCatalog", "check_partners", "load_catalog"]


@dataclass(frozen=True)
class EventCatalog:
    """Event classes by type, then version."""

    classes: dict[str, dict[int, type[Event]]] = field(default_factory=dict)

    def __iter__(self) -> Iterator[type[Event]]:
        for versions in self.classes.values():
            yield from versions.values()

    def __bool__(self) -> bool:
        return bool(self.classes)

    def versions(self, event_type: str) -> dict[int, type[Event]]:
        """Every known version of a type (empty if the type is unknown)."""
        return self.classes.get(event_type, {})

    def get(self, event_type: str, version: int | None = None) -> type[Event]:
        """The class of a type at ``version`` (default: the newest); ConfigError if unknown."""
        versions = self.versions(event_type)
        if not versions:
            known = ", ".join(sorted(self.classes)) or "none (list modules under events:)"
            raise ConfigError(f"unknown event type {event_type!r}; known types: {known}")
        if version is None:
            return versions[max(versions)]
        if version not in versions:
            raise ConfigError(
                f"event type {event_type!r} has no version {version}; "
                f"known versions: {sorted(versions)}"
            )
        return versions[version]


def load_catalog(modules: Sequence[str], base_dir: Path) -> EventCatalog:
    """Import ``modules`` (the config's folder first on the import path) and catalogue the
    events they hold. Raises ConfigError naming ``events[i]`` for a module that fails to
    import, and for two classes that claim one type and version."""
    catalog = EventCatalog()
    origin: dict[tuple[str, int], str] = {}
    # The config's folder stays on the path: a module may import more of its package later.
    if str(base_dir) not in sys.path:
        sys.path.insert(0, str(base_dir))
    for index, name in enumerate(modules):
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # any error in the user's module is a config error here
            raise ConfigError(
                f"events[{index}]: cannot import {name!r}: {type(exc).__name__}: {exc}"
            ) from exc
        for value in list(vars(module).values()):
            if not (isinstance(value, type) and issubclass(value, Event)) or value is Event:
                continue
            spec = value.__event__
            key = (spec.type, spec.version)
            seen = catalog.classes.setdefault(spec.type, {}).get(spec.version)
            if seen is not None and seen is not value:
                raise ConfigError(
                    f"events[{index}]: {spec.class_path} and {origin[key]} both declare "
                    f"event type {spec.type!r} version {spec.version}"
                )
            catalog.classes[spec.type][spec.version] = value
            origin[key] = spec.class_path
    return catalog


def check_partners(config: RouterConfig, catalog: EventCatalog) -> None:
    """What the config says about event classes holds for the catalogued ones: each payload
    projection names only fields of every version it applies to, and each pinned version is
    declared and reachable by downcasters. ConfigError names the YAML path. Without an
    ``events:`` list there is nothing to check projections against (staging still checks
    pins)."""
    pins = {name: broker.versions for name, broker in config.brokers.items() if broker.versions}
    if catalog:
        for name, broker in config.brokers.items():
            if broker.expose is not None:
                _check_projections(name, broker, catalog)
    check_pins(pins)


def _check_projections(name: str, broker: BrokerSettings, catalog: EventCatalog) -> None:
    """A projection applies to every version the partner receives (each published one, or
    the pinned one) unless that version has its own (``type@version``); a field missing from
    one of them would be dropped from it without a word, so it is refused."""
    assert broker.expose is not None
    projections = broker.expose.projections()
    for (event_type, version), kept in projections.items():
        where = f"brokers.{name}.expose.payload.{event_type}"
        if version is not None:
            where += f"@{version}"
        versions = catalog.versions(event_type)
        if not versions:
            known = ", ".join(sorted(catalog.classes))
            raise ConfigError(f"{where}: unknown event type; known types: {known}")
        received = _received(broker, event_type, versions)
        if version is None:
            applies = [v for v in received if (event_type, v) not in projections]
        else:
            _check_received(where, broker, event_type, version, versions, received)
            applies = [version]
        for each in applies:
            own = version is not None
            legacy = not own and event_type not in broker.versions
            several = not own and len(received) > 1
            _check_fields(where, event_type, each, kept, versions, legacy=legacy, several=several)


def _check_fields(
    where: str,
    event_type: str,
    version: int,
    kept: list[str],
    versions: dict[int, type[Event]],
    *,
    legacy: bool,
    several: bool,
) -> None:
    """Refuse a list naming fields ``version`` lacks. ``legacy``: the list is a type's own on
    an unpinned partner, which releases before TYPE@VERSION checked against the newest
    version only, so what they accepted is accepted with a warning (``_warn_newest_only``).
    ``several``: the list applies to several published versions."""
    declared = versions[version].model_fields
    unknown = [field for field in kept if field not in declared]
    if not unknown:
        return
    newest = versions[max(versions)].model_fields
    shared = [field for field in kept if field in declared]
    if legacy and shared and all(field in newest for field in kept):
        _warn_newest_only(where, event_type, version, unknown, shared)
        return
    hint = ""
    if several:
        hint = (
            f"; version {version} is still published: give it its own projection "
            f"({event_type}@{version}: [...])"
        )
    raise ConfigError(
        f"{where}: version {version} has no field {', '.join(map(repr, unknown))}; "
        f"its fields: {', '.join(declared)}{hint}"
    )


def _warn_newest_only(
    where: str, event_type: str, version: int, unknown: list[str], shared: list[str]
) -> None:
    """What such a config sends is what ``TYPE@VERSION: [the fields it has]`` sends: say so,
    and that writing it keeps the messages as they are."""
    replacement = f"{event_type}@{version}: [{', '.join(shared)}]"
    warnings.warn(
        f"{where}: version {version} has no field {', '.join(map(repr, unknown))}, so its "
        f"messages carry {', '.join(shared)} only; to keep that, add under expose.payload: "
        f"'{replacement}' (or list the version {version} fields this partner should get); "
        "a later release refuses the list without it",
        ConfigDeprecationWarning,
        stacklevel=2,
    )


def _received(
    broker: BrokerSettings, event_type: str, versions: dict[int, type[Event]]
) -> list[int]:
    """The versions of a type this partner receives: its pin, else every published version
    (for a type not published, the newest, which it would receive once published)."""
    pinned = broker.versions.get(event_type)
    if pinned is not None:
        return [pinned]
    published = sorted(v for v, cls in versions.items() if cls.__event__.published)
    return published or [max(versions)]


def _check_received(
    where: str,
    broker: BrokerSettings,
    event_type: str,
    version: int,
    versions: dict[int, type[Event]],
    received: list[int],
) -> None:
    """A version's own projection must name a version this partner receives."""
    if version not in versions:
        raise ConfigError(
            f"{where}: event type {event_type!r} has no version {version}; "
            f"known versions: {sorted(versions)}"
        )
    if version in received:
        return
    pinned = broker.versions.get(event_type)
    if pinned is not None:
        raise ConfigError(
            f"{where}: this broker is pinned to version {pinned} (versions.{event_type}), so "
            f"it never receives version {version}"
        )
    raise ConfigError(
        f"{where}: version {version} is not published (published=True), so no partner receives it"
    )
