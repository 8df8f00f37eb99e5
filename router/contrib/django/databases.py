"""Which router database (a key of ``databases:`` in ``config.yaml``) a Django database is.

A Django database and a router database are the same when they are of one kind and point at
one place: the same host, port and database name (``localhost``, ``127.0.0.1``, ``::1`` and
an empty ``HOST`` count as one host; no port means the kind's default), or the same SQLite
file. Users, passwords and options are not compared. Nothing here opens a connection.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from envelopes import ConfigError, StagingError
from router._db import sqlite_path
from router.config import DatabaseSettings, RouterConfig

__all__ = [
    "Location",
    "database_settings",
    "django_location",
    "matching_database",
    "router_database",
    "router_location",
]

_PORTS = {"postgresql": 5432, "mysql": 3306}
_LOCAL_HOSTS = {"", "localhost", "127.0.0.1", "::1"}


@dataclass(frozen=True, slots=True)
class Location:
    """Where a database lives: what two configs must agree on to name the same one."""

    kind: str
    host: str = ""
    port: int = 0
    name: str = ""

    def __str__(self) -> str:
        if self.kind == "sqlite":
            return f"sqlite file {self.name}"
        return f"{self.kind} {self.host}:{self.port}/{self.name}"


def _host(host: str | None) -> str:
    host = (host or "").strip().lower()
    return "localhost" if host in _LOCAL_HOSTS else host


def _in_memory(name: str) -> bool:
    return name in ("", ":memory:") or "mode=memory" in name


def django_location(connection: Any) -> Location | None:
    """Where the database of Django's ``connection`` lives (``None``: in memory, or a
    backend the router has no kind for)."""
    kind = str(connection.vendor)
    settings = connection.settings_dict
    name = str(settings.get("NAME") or "")
    if kind == "sqlite":
        return None if _in_memory(name) else Location(kind, name=str(Path(name).resolve()))
    if kind not in _PORTS:
        return None
    port = int(settings.get("PORT") or _PORTS[kind])
    return Location(kind, _host(settings.get("HOST")), port, name)


def router_location(database: DatabaseSettings, base_dir: Path) -> Location | None:
    """Where a router database lives (``None``: an in-memory SQLite database)."""
    if database.kind == "sqlite":
        try:
            return Location("sqlite", name=str(sqlite_path(database, base_dir)))
        except ValueError:
            return None
    return _router_locations(database)[0]


def _router_locations(database: DatabaseSettings) -> list[Location]:
    """One per host of a (PostgreSQL multi-host) URL: Django's database is any of them."""
    name = unquote(urlsplit(database.url.get_secret_value()).path.lstrip("/"))
    hosts = database.hosts() or [("", _PORTS[database.kind])]
    return [Location(database.kind, _host(host), port, name) for host, port in hosts]


def matching_database(config: RouterConfig, connection: Any) -> str | None:
    """The one router database at the same place as Django's ``connection``, or ``None``
    (none, or several: then no guess is made)."""
    here = django_location(connection)
    if here is None:
        return None
    found = [
        name
        for name, database in config.databases.items()
        if (
            here in _router_locations(database)
            if database.kind != "sqlite"
            else router_location(database, config.base_dir) == here
        )
    ]
    return found[0] if len(found) == 1 else None


def router_database(config: RouterConfig, connection: Any) -> str:
    """The router database that events staged on ``connection`` belong to: the one at the
    same place, else the only one configured; ``StagingError`` when neither exists."""
    name = matching_database(config, connection)
    if name is not None:
        return name
    if len(config.databases) == 1:
        return next(iter(config.databases))
    here = django_location(connection)
    raise StagingError(
        f"Django database {connection.alias!r} ({here or 'in memory'}) is none of the "
        f"router's databases {sorted(config.databases)}: pass database=... to stage()"
    )


def database_settings(connection: Any) -> DatabaseSettings:
    """The router's settings for the database of Django's ``connection`` (its URL built from
    ``NAME``, ``USER``, ``PASSWORD``, ``HOST`` and ``PORT``; ``OPTIONS`` are not carried)."""
    kind = str(connection.vendor)
    settings = connection.settings_dict
    name = str(settings.get("NAME") or "")
    if kind == "sqlite":
        if _in_memory(name):
            raise ConfigError(
                f"Django database {connection.alias!r} is an in-memory SQLite database, which "
                "no other connection can reach; give it a file (for tests: TEST NAME)"
            )
        return DatabaseSettings.model_validate({"url": f"sqlite:///{Path(name).resolve()}"})
    if kind not in _PORTS:
        raise ConfigError(
            f"Django database {connection.alias!r} is {kind}; the outbox runs on PostgreSQL, "
            "MySQL/MariaDB and SQLite"
        )
    user = quote(str(settings.get("USER") or ""), safe="")
    password = quote(str(settings.get("PASSWORD") or ""), safe="")
    credentials = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    host = str(settings.get("HOST") or "")
    host = f"[{host}]" if ":" in host else host  # an IPv6 address
    port = f":{settings['PORT']}" if settings.get("PORT") else ""
    url = f"{kind}://{credentials}{host}{port}/{quote(name, safe='')}"
    return DatabaseSettings.model_validate({"url": url})
