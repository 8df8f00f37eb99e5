"""``router status`` and the console's backlog: per (database, target) the queue, its ages,
failures, circuit and pause, the last minute's flow (router.ops.flow) and the limits the
config sets."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from brokers import BrokerSettings
from router.config import OutboxSettings, RouterConfig
from router.ops import connections
from router.ops.flow import WINDOW, Flow, flows, time_to_empty
from router.ops.outbox import OPEN, RETRY_WINDOW
from router.ops.schema import outbox, targets
from router.ops.times import utc as _utc
from router.relay.circuit import stale_after

__all__ = ["HELD_STATUSES", "TargetStatus", "status"]


@dataclass(frozen=True)
class TargetStatus:
    """One (database, target) at a glance."""

    database: str
    target: str
    pending: int = 0
    in_flight: int = 0
    failed: int = 0
    abandoned: int = 0
    # Rows held (``ordering: hold``) or parked (``ordering: park``) behind a head refused for
    # good, the keys they stop, and how long the oldest of those heads has been waiting.
    held: int = 0
    parked: int = 0
    held_keys: int = 0
    parked_keys: int = 0
    oldest_held_age: float | None = None
    # None when not counted (``status(published=False)``): unknown, which 0 would not say.
    published: int | None = 0
    oldest_claimable_age: float | None = None
    retries_per_minute: float = 0.0
    circuit: str = "closed"
    circuit_since: str | None = None
    paused: bool = False
    last_error: str | None = None  # the latest row error; else an open circuit's reason
    # The last minute (router.ops.flow), and the target's limits from the config.
    staged_per_second: float = 0.0
    published_per_second: float = 0.0
    time_to_empty_seconds: float | None = None  # None: not shrinking
    delivered_within_slo: float | None = None
    slo_seconds: float = 1.0
    rate_limit: dict[str, Any] | None = None
    max_in_flight: int | None = None
    on_backlog: dict[str, Any] | None = None

    @property
    def new(self) -> int:
        """Queued rows never tried (pending)."""
        return self.pending

    @property
    def retrying(self) -> int:
        """Queued rows waiting for their next attempt (failed)."""
        return self.failed

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self) | {"new": self.new, "retrying": self.retrying}


async def status(
    config: RouterConfig,
    database: str | None = None,
    *,
    published: bool = True,
    flow_reuse: float = 0.0,
) -> list[TargetStatus]:
    """Counts and ages per (database, target), for every configured target.

    Counting published rows reads the whole table; ``published=False`` skips it and reads
    only unfinished and abandoned rows, through their partial indexes (what metrics and the
    dashboard poll).
    """
    found: list[TargetStatus] = []
    for name in connections.database_names(config, database):
        async with connections.connect(config, name) as conn:
            found.extend(
                await _status_of(
                    conn, name, config.brokers_of(name), published, flow_reuse, config.outbox
                )
            )
    return found


class _Counts(NamedTuple):
    """One target's rows by state, from ``_counts_query``; all zero for a target without."""

    pending: int = 0  # never tried, or processing with its lease run out
    in_flight: int = 0
    failed: int = 0
    abandoned: int = 0
    held: int = 0
    parked: int = 0
    held_keys: int = 0
    parked_keys: int = 0
    published: int = 0
    oldest_claimable: datetime | None = None
    oldest_held: datetime | None = None
    recent_attempts: int = 0  # failed or abandoned within RETRY_WINDOW
    open_staged: int = 0  # unfinished, staged within the flow's WINDOW

    @classmethod
    def of(cls, row: sa.Row[Any]) -> _Counts:
        """From a row of ``_counts_query``: its sums are NULL where no row matched."""
        values = row._mapping
        return cls(
            **{name: int(values[name] or 0) for name in _COUNTED},
            oldest_claimable=_utc(values["oldest_claimable"]),
            oldest_held=_utc(values["oldest_held"]),
        )

    @property
    def queued(self) -> int:
        """Rows waiting to be delivered: pending, in flight or waiting to retry."""
        return self.pending + self.in_flight + self.failed


_COUNTED = tuple(name for name in _Counts._fields if not name.startswith("oldest_"))
HELD_STATUSES = ("held", "parked")
"""Rows that stop their stream key until an operator releases it (``router release``)."""


def _counts_query(now: datetime, published: bool) -> sa.Select[Any]:
    """Per target, the columns of ``_Counts`` (labelled as its fields)."""
    o = outbox
    due = sa.case((o.c.status == "processing", o.c.locked_until), else_=o.c.available_at)
    claimable = sa.and_(o.c.status.in_(OPEN), due <= now)
    lease_over = sa.and_(o.c.status == "processing", o.c.locked_until <= now)
    recent_attempt = sa.and_(
        o.c.status.in_(("failed", "abandoned")), o.c.last_attempt_at > now - RETRY_WINDOW
    )
    oldest = sa.func.min(sa.case((claimable, o.c.created_at)))
    # A key's head is its held (or first parked) row; it waits since its last attempt.
    head = sa.and_(o.c.status.in_(HELD_STATUSES), o.c.last_error.is_not(None))
    oldest_held = sa.func.min(sa.case((head, o.c.last_attempt_at)))
    query = sa.select(
        o.c.target,
        _count(sa.or_(o.c.status == "pending", lease_over)).label("pending"),
        _count(sa.and_(o.c.status == "processing", o.c.locked_until > now)).label("in_flight"),
        _count(o.c.status == "failed").label("failed"),
        _count(o.c.status == "abandoned").label("abandoned"),
        _count(o.c.status == "held").label("held"),
        _count(o.c.status == "parked").label("parked"),
        _keys(o.c.status == "held").label("held_keys"),
        _keys(o.c.status == "parked").label("parked_keys"),
        _count(o.c.status == "published").label("published"),
        sa.type_coerce(oldest, o.c.created_at.type).label("oldest_claimable"),
        sa.type_coerce(oldest_held, o.c.last_attempt_at.type).label("oldest_held"),
        _count(recent_attempt).label("recent_attempts"),
        _count(sa.and_(o.c.status.in_(OPEN), o.c.created_at > now - WINDOW)).label("open_staged"),
    ).group_by(o.c.target)
    if not published:
        query = query.where(o.c.status.in_((*OPEN, "abandoned", *HELD_STATUSES)))
    return query


def _count(condition: Any) -> Any:
    return sa.func.sum(sa.case((condition, 1), else_=0))


def _keys(condition: Any) -> Any:
    """The distinct stream keys of the rows matching ``condition``."""
    return sa.func.count(sa.distinct(sa.case((condition, outbox.c.stream_key))))


async def _status_of(
    conn: AsyncConnection,
    database: str,
    configured: Mapping[str, BrokerSettings],
    published: bool,
    flow_reuse: float = 0.0,
    outbox_settings: OutboxSettings | None = None,
) -> list[TargetStatus]:
    now = connections.now()
    rows = (await conn.execute(_counts_query(now, published))).all()
    counts = {row.target: _Counts.of(row) for row in rows}
    states = {r.target: r for r in (await conn.execute(sa.select(targets))).all()}
    errors = await _latest_errors(conn)
    slos = {name: settings.slo_seconds for name, settings in configured.items()}
    open_staged = {target: c.open_staged for target, c in counts.items()}
    moving = await flows(conn, slos, open_staged, now, reuse=flow_reuse)
    breaker = outbox_settings or OutboxSettings()
    result = []
    for target in sorted(set(configured) | set(counts)):
        state, settings = states.get(target), configured.get(target)
        result.append(
            _target_status(
                database,
                target,
                counts.get(target, _Counts()),
                published=published,
                state=state,
                settings=settings,
                circuit=_circuit(state, settings, breaker, now),
                flow=moving.get(target, Flow()),
                error=errors.get(target),
                now=now,
            )
        )
    return result


def _target_status(
    database: str,
    target: str,
    counts: _Counts,
    *,
    published: bool,
    state: Any,
    flow: Flow,
    error: str | None,
    settings: BrokerSettings | None,
    circuit: str,
    now: datetime,
) -> TargetStatus:
    paused = bool(state.paused) if state else False
    # Rows behind an open circuit wait untried, with no error of their own: the circuit's
    # reason is why they wait.
    if error is None and circuit == "open" and state is not None:
        error = state.circuit_error
    oldest, held_since = counts.oldest_claimable, counts.oldest_held
    return TargetStatus(
        database=database,
        target=target,
        pending=counts.pending,
        in_flight=counts.in_flight,
        failed=counts.failed,
        abandoned=counts.abandoned,
        held=counts.held,
        parked=counts.parked,
        held_keys=counts.held_keys,
        parked_keys=counts.parked_keys,
        oldest_held_age=round((now - held_since).total_seconds(), 3) if held_since else None,
        published=counts.published if published else None,
        oldest_claimable_age=round((now - oldest).total_seconds(), 3) if oldest else None,
        retries_per_minute=round(counts.recent_attempts / (RETRY_WINDOW.total_seconds() / 60), 2),
        circuit=circuit,
        circuit_since=connections.iso(state.circuit_since) if state else None,
        paused=paused,
        last_error=error,
        staged_per_second=flow.staged_per_second,
        published_per_second=flow.published_per_second,
        time_to_empty_seconds=time_to_empty(counts.queued, flow, paused),
        delivered_within_slo=flow.delivered_within_slo,
        **_limits(settings),
    )


def _circuit(
    state: Any, settings: BrokerSettings | None, outbox_settings: OutboxSettings, now: datetime
) -> str:
    """The recorded circuit; "stale" for an open one its processor stopped renewing (the
    process is gone: killed, or its host lost), which is nobody's state now."""
    if state is None:
        return "closed"
    circuit = str(state.circuit)
    since = _utc(state.circuit_since)
    if circuit != "open" or since is None:
        return circuit
    timeout = settings.connect_timeout if settings is not None else 5.0
    if (now - since).total_seconds() > stale_after(outbox_settings, timeout):
        return "stale"
    return circuit


def _limits(settings: BrokerSettings | None) -> dict[str, Any]:
    """What the config says about a target's pace, as status shows it."""
    if settings is None:  # rows of a target the config no longer has
        return {}
    limit = settings.rate_limit
    return {
        "slo_seconds": settings.slo_seconds,
        "rate_limit": (
            None
            if limit is None
            else {"messages_per_second": limit.messages_per_second, "burst": limit.capacity}
        ),
        "max_in_flight": getattr(settings, "max_in_flight", None),
        "on_backlog": settings.on_backlog.model_dump() if settings.on_backlog else None,
    }


async def _latest_errors(conn: AsyncConnection) -> dict[str, str]:
    o = outbox
    latest = (
        sa.select(o.c.target, sa.func.max(o.c.last_attempt_at).label("at"))
        .where(o.c.status.in_(("failed", "abandoned")), o.c.last_error.is_not(None))
        .group_by(o.c.target)
        .subquery()
    )
    query = sa.select(o.c.target, o.c.last_error).join(
        latest, sa.and_(o.c.target == latest.c.target, o.c.last_attempt_at == latest.c.at)
    )
    return {r[0]: r[1] for r in (await conn.execute(query)).all()}
