"""The configuration model (``config.yaml``): databases, brokers, outbox and HTTP settings.

Load it with ``load_config(path)`` (see ``router._yaml``): ``${VAR}`` and ``${VAR:-default}``
are taken from the environment, and every error names the YAML path and what is wrong,
never the value (values may be secrets).
"""

from __future__ import annotations

import functools
import re
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import parse_qsl

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    field_validator,
    model_validator,
)

from brokers import AnyBrokerSettings, BrokerSettings, redact_url

__all__ = [
    "CircuitSettings",
    "DatabaseSettings",
    "Duration",
    "HttpSettings",
    "OutboxSettings",
    "RetentionSettings",
    "RetrySettings",
    "RouterConfig",
]

NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_-]{0,62}$"


class RetrySettings(BaseModel):
    """Per-row retry schedule: ``base_delay * 2^(attempt-1)``, capped, then ± jitter."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_attempts: int = Field(10, ge=1, description="Attempts before a row is abandoned.")
    base_delay: float = Field(
        1.0, gt=0, description="Seconds before the first retry; each later one doubles it."
    )
    max_delay: float = Field(
        300.0, gt=0, description="Cap of the doubling delay, in seconds (then spread by ±jitter)."
    )
    jitter: float = Field(0.2, ge=0, le=1, description="Spread of each delay, as a fraction.")

    @model_validator(mode="after")
    def _ordered(self) -> RetrySettings:
        if self.max_delay < self.base_delay:
            raise ValueError("max_delay must be at least base_delay")
        return self


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def _duration(value: Any) -> Any:
    """Accept 7d, 12h, 30m, 45s, 1w (or seconds, or ISO 8601) for durations."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text.replace(".", "", 1).isdigit():
            return timedelta(seconds=float(text))
        if text and text[-1] in _UNITS and text[:-1].replace(".", "", 1).isdigit():
            return timedelta(seconds=float(text[:-1]) * _UNITS[text[-1]])
    return value


Duration = Annotated[timedelta, BeforeValidator(_duration)]


class RetentionSettings(BaseModel):
    """How long finished rows are kept, and how often ``router serve`` removes older ones."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    published: Duration = Field(timedelta(days=7), description="Keep published rows this long.")
    abandoned: Duration = Field(
        timedelta(days=30),
        description="Keep abandoned rows this long, and the gap markers no message named yet.",
    )
    inbox: Duration = Field(
        timedelta(days=14),
        description="Keep consumers' dedup records this long; a duplicate arriving later is "
        "applied again.",
    )
    interval: Duration = Field(
        timedelta(minutes=10), description="How often router serve cleans up (0: never)."
    )
    batch_size: int = Field(5000, ge=1, description="Rows deleted per statement.")


class CircuitSettings(BaseModel):
    """How a host that cannot reach a target's broker probes it before claiming again."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    open_after: float = Field(
        0.0,
        ge=0,
        description="Deprecated, and ignored: a host's circuit now opens at the first publish "
        "its broker does not answer (its rows go back untried, for other hosts).",
    )
    probe_max_delay: float = Field(
        3.0,
        gt=0,
        description="Longest wait between two probes of an open circuit, in seconds: a host "
        "whose path to the broker heals claims again within about this long.",
    )


class OutboxSettings(BaseModel):
    """How processors claim, publish and retry rows."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    batch_size: int = Field(500, ge=1, le=10_000, description="Rows claimed at once per target.")
    lease_seconds: float = Field(
        30.0,
        gt=0,
        description="Seconds a claim holds its rows before others may take them; extended "
        "while a batch is still being published.",
    )
    poll_interval: float = Field(
        60.0,
        gt=0,
        description="Seconds between fallback polls when no wake-up arrives (NOTIFY covers "
        "PostgreSQL).",
    )
    linger: float = Field(
        0.0,
        ge=0,
        le=0.1,
        description="Seconds a processor waits after a short batch that sent rows before it "
        "claims again, instead of going idle: while rows keep coming, fewer and larger "
        "batches, and on PostgreSQL no NOTIFY from the stagers meanwhile, for up to this much "
        "more latency (0: claim again only when woken).",
    )
    max_payload_bytes: int = Field(
        262_144,
        ge=1024,
        description="Largest stored envelope, in bytes; stage() rejects bigger events.",
    )
    vacuum_after_rows: int = Field(
        50_000,
        ge=0,
        description="PostgreSQL: VACUUM the outbox after this many rows were "
        "marked, as well as autovacuum (0: leave it to autovacuum).",
    )
    durable_bookkeeping: bool = Field(
        False,
        description="PostgreSQL: the router's claims and marks wait for the WAL flush. Off: a "
        "server crash may deliver again what was published in its last moments (well under a "
        "second); on: an fsync per claim and per mark.",
    )
    shutdown_grace_seconds: float = Field(
        10.0, ge=0, description="Seconds a stopping router waits for in-flight publishes."
    )
    retry: RetrySettings = Field(
        default_factory=RetrySettings, description="When a failed row is tried again."
    )
    circuit: CircuitSettings = Field(
        default_factory=CircuitSettings,
        description="When a target stops claiming because its broker is unreachable.",
    )
    retention: RetentionSettings = Field(
        default_factory=RetentionSettings,
        description="How long finished rows are kept, and how often they are removed.",
    )


class HttpSettings(BaseModel):
    """Where ``router serve`` answers health checks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(
        True, description="Serve health checks, metrics and the console; false: no HTTP at all."
    )
    bind: str = Field("127.0.0.1:8642", description="host:port to listen on.")
    token: SecretStr | None = Field(
        None,
        description="If set, every GET endpoint but /healthz, /readyz and the console page / "
        "needs 'Authorization: Bearer <token>'; unset, the console's POST actions are off. Take "
        "it from the environment: ${ROUTER_HTTP_TOKEN}.",
    )
    ready_requires_partners: bool = Field(
        False,
        description="/readyz also answers 503 while a partner (non-internal) broker's circuit "
        "is open. Off: only the databases and the internal broker decide readiness; partner "
        "circuits are listed in /readyz and /healthz.",
    )

    @field_validator("bind")
    @classmethod
    def _host_port(cls, bind: str) -> str:
        host, _, port = bind.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("must be host:port, e.g. 127.0.0.1:8642")
        return bind

    @property
    def host(self) -> str:
        """The host part of ``bind``."""
        return self.bind.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        """The port part of ``bind``."""
        return int(self.bind.rpartition(":")[2])


# URL scheme -> kind of database. MariaDB speaks MySQL's protocol and SQL; one store serves both.
_KINDS = {
    "postgresql": "postgresql",
    "postgres": "postgresql",
    "mysql": "mysql",
    "mariadb": "mysql",
    "sqlite": "sqlite",
}


_DEFAULT_PORTS = {"postgresql": 5432, "mysql": 3306}
# What target_session_attrs may ask for: the router writes, so a session on a standby (or a
# server set read-only) could only fail. libpq's default, "any", is kept when asked for.
_WRITABLE_SESSIONS = ("read-write", "primary", "any")


def _servers(url: str) -> list[tuple[str, int | None]]:
    """The (host, port) pairs of a URL's host list, ``[host]`` for IPv6; [] when it names
    no host. ValueError says which entry is not ``host[:port]``."""
    netloc = url.partition("://")[2].partition("/")[0].partition("?")[0]
    hosts = netloc.rpartition("@")[2]
    if not hosts:
        return []
    return [_server(entry, number) for number, entry in enumerate(hosts.split(","), 1)]


def _server(entry: str, number: int) -> tuple[str, int | None]:
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = entry.partition(":")
    if not host or not (port == "" or (port.isdigit() and 0 < int(port) < 65536)):
        # The entry is not quoted: a password with an unescaped '/' would end up in it.
        raise ValueError(f"host {number} of the URL is not host[:port] (several: h1:p1,h2:p2)")
    return host, int(port) if port else None


def _check_servers(url: str, kind: str) -> None:
    """The host list parses; several hosts on PostgreSQL only; a session that can write."""
    if len(_servers(url)) > 1 and kind != "postgresql":
        raise ValueError("several hosts in one URL are supported on PostgreSQL only")
    query = dict(parse_qsl(url.partition("?")[2]))
    attrs = query.get("target_session_attrs")
    if attrs is not None and attrs not in _WRITABLE_SESSIONS:
        raise ValueError(
            f"target_session_attrs={attrs} cannot work: the router writes to this database; "
            f"use one of {', '.join(_WRITABLE_SESSIONS)}"
        )


@functools.lru_cache(maxsize=64)
def _kind_of(url: str) -> str:
    """The kind of database ``url`` names (its scheme known: validated), once per URL:
    stage() asks on every call, where parsing it each time was a tenth of its own work."""
    return _KINDS[url.partition("://")[0].partition("+")[0]]


class DatabaseSettings(BaseModel):
    """One database holding a ``router_outbox`` table."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: SecretStr = Field(
        description="postgresql://..., mysql://... (or mariadb://...) or sqlite:///path "
        "(relative to config). PostgreSQL may name several hosts for failover "
        "(postgresql://h1:5432,h2:5432/db): the router connects to the one that accepts "
        "writes (target_session_attrs=read-write unless the URL says otherwise)."
    )
    brokers: list[str] | None = Field(
        None, description="Brokers this database publishes to; default: all of them."
    )
    pool_size: int = Field(4, ge=1, le=100, description="Connections the router keeps open.")
    wakeup: Literal["auto", "log", "notify", "poll"] = Field(
        "auto",
        description="How the relay learns of new rows: 'log' reads the database's own log "
        "(PostgreSQL logical decoding, the MySQL/MariaDB binlog); 'notify' (PostgreSQL) "
        "has stage() notify only while a relay is idle and listening; 'poll' looks for new "
        "rows on a timer (stage() then never notifies); 'auto' takes the best the server "
        "allows. SQLite always watches its WAL file.",
    )

    @model_validator(mode="after")
    def _wakeup_fits_kind(self) -> DatabaseSettings:
        if self.wakeup == "notify" and self.kind != "postgresql":
            raise ValueError("wakeup 'notify' needs PostgreSQL; use auto, log or poll")
        return self

    @model_validator(mode="before")
    @classmethod
    def _url_shorthand(cls, value: Any) -> Any:
        return {"url": value} if isinstance(value, str) else value

    @field_validator("url")
    @classmethod
    def _supported_scheme(cls, url: SecretStr) -> SecretStr:
        scheme = url.get_secret_value().partition("://")[0].partition("+")[0]
        if scheme not in _KINDS:
            raise ValueError(
                "only postgresql://, mysql:// (or mariadb://) and sqlite:/// databases "
                "are supported"
            )
        if _KINDS[scheme] != "sqlite":
            _check_servers(url.get_secret_value(), _KINDS[scheme])
        return url

    @property
    def kind(self) -> str:
        """'postgresql', 'mysql' (MySQL or MariaDB) or 'sqlite'."""
        return _kind_of(self.url.get_secret_value())

    @property
    def notifies(self) -> bool:
        """Whether ``stage()`` may wake an idle relay with NOTIFY (PostgreSQL, unless the
        relay only polls). It does only while a relay listens idle: never while relays follow
        the log, but at once when one falls back to LISTEN."""
        return self.kind == "postgresql" and self.wakeup != "poll"

    def public_url(self) -> str:
        """The URL without credentials, for logs and status output."""
        return redact_url(self.url.get_secret_value())

    def hosts(self) -> list[tuple[str, int]]:
        """The servers the URL names, in order, each with its port (the kind's default when
        the URL has none): several in libpq's multi-host form
        (``postgresql://h1:5432,h2:5432/db``), none for SQLite or a Unix socket."""
        if self.kind == "sqlite":
            return []
        default = _DEFAULT_PORTS[self.kind]
        return [(host, port or default) for host, port in _servers(self.url.get_secret_value())]


class RouterConfig(BaseModel):
    """The whole ``config.yaml``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    service: str = Field(
        "app", pattern=NAME_PATTERN, description="This system's name: the envelopes' 'source'."
    )
    databases: dict[str, DatabaseSettings] = Field(
        min_length=1,
        description="The databases holding outbox rows, by name (a name may map to its URL alone).",
    )
    brokers: dict[str, AnyBrokerSettings] = Field(
        min_length=1,
        description="The brokers events are delivered to, by name; 'type' picks the kind.",
    )
    outbox: OutboxSettings = Field(
        default_factory=OutboxSettings, description="How processors claim, publish and retry rows."
    )
    http: HttpSettings = Field(
        default_factory=HttpSettings, description="The HTTP endpoint of router serve."
    )
    events: list[str] = Field(
        default_factory=list,
        description="Modules that define this service's events (imported by serve, preview "
        "and contract; the config's folder is on the import path).",
    )

    _base_dir: Path = PrivateAttr(default_factory=Path.cwd)

    @field_validator("brokers")
    @classmethod
    def _one_internal(cls, brokers: dict[str, Any]) -> dict[str, Any]:
        internal = [name for name, b in brokers.items() if b.internal]
        if len(internal) > 1:
            raise ValueError(f"only one broker may be internal; found {internal}")
        return brokers

    @field_validator("events")
    @classmethod
    def _module_names(cls, modules: list[str]) -> list[str]:
        for name in modules:
            if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", name):
                raise ValueError(f"{name!r} is not a module name (e.g. shop.events)")
        return modules

    @field_validator("databases", "brokers")
    @classmethod
    def _names(cls, named: dict[str, Any]) -> dict[str, Any]:
        for name in named:
            if not re.match(NAME_PATTERN, name):
                raise ValueError(
                    f"name {name!r} must start with a letter and hold only letters, digits, _ or -"
                )
        return named

    @model_validator(mode="after")
    def _known_brokers(self) -> RouterConfig:
        for db_name, db in self.databases.items():
            unknown = sorted(set(db.brokers or ()) - set(self.brokers))
            if unknown:
                raise ValueError(f"databases.{db_name}.brokers: unknown broker(s) {unknown}")
        return self

    @property
    def base_dir(self) -> Path:
        """The folder of the config file; relative paths in the config start here."""
        return self._base_dir

    def with_base_dir(self, base_dir: Path) -> RouterConfig:
        """Return this config anchored at ``base_dir``."""
        self._base_dir = base_dir.resolve()
        return self

    def brokers_of(self, database: str) -> dict[str, BrokerSettings]:
        """The brokers a database publishes to, by name."""
        names = self.databases[database].brokers
        return {n: b for n, b in self.brokers.items() if names is None or n in names}

    def resolve_path(self, path: str) -> Path:
        """A path from the config, made absolute against the config's folder."""
        candidate = Path(path).expanduser()
        return candidate if candidate.is_absolute() else self.base_dir / candidate
