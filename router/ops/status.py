"""``router status`` and the console's backlog: per (database, target) the queue, its ages,
failures, circuit and pause, the last minute's flow (router.ops.flow) and the limits the
config sets."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from brokers import BrokerSettings
from router.config import OutboxSettings, RouterConfig
from router.ops import connections
from router.ops.flow import WINDOW, Flow, flows, time_to_empty
from router.ops.operations import OPEN, RETRY_WINDOW
from router.ops.schema import outbox, targets
from router.ops.times import utc as _utc
from router.relay.circuit import stale_after

__all__ = ["TargetStatus", "status"]


@dataclass(frozen=True)
class TargetStatus:
    """One (database, target) at a glance."""

    database: str
    target: str
    pending: int = 0
    in_flight: int = 0
    failed: int = 0
    abandoned: int = 0
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


async def _status_of(
    conn: AsyncConnection,
    database: str,
    configured: Mapping[str, BrokerSettings],
    published: bool,
    flow_reuse: float = 0.0,
    outbox_settings: OutboxSettings | None = None,
) -> list[TargetStatus]:
    now = connections.now()
    o = outbox
    due = sa.case((o.c.status == "processing", o.c.locked_until), else_=o.c.available_at)
    claimable = sa.and_(o.c.status.in_(OPEN), due <= now)

    def count(condition: Any) -> Any:
        return sa.func.sum(sa.case((condition, 1), else_=0))

    query = sa.select(
        o.c.target,
        count(
            sa.or_(
                o.c.status == "pending",
                sa.and_(o.c.status == "processing", o.c.locked_until <= now),
            )
        ),
        count(sa.and_(o.c.status == "processing", o.c.locked_until > now)),
        count(o.c.status == "failed"),
        count(o.c.status == "abandoned"),
        count(o.c.status == "published"),
        sa.type_coerce(sa.func.min(sa.case((claimable, o.c.created_at))), o.c.created_at.type),
        count(
            sa.and_(
                o.c.status.in_(("failed", "abandoned")), o.c.last_attempt_at > now - RETRY_WINDOW
            )
        ),
        count(sa.and_(o.c.status.in_(OPEN), o.c.created_at > now - WINDOW)),
    ).group_by(o.c.target)
    if not published:
        query = query.where(o.c.status.in_((*OPEN, "abandoned")))
    rows = {r[0]: r for r in (await conn.execute(query)).all()}
    states = {r.target: r for r in (await conn.execute(sa.select(targets))).all()}
    errors = await _latest_errors(conn)
    slos = {name: settings.slo_seconds for name, settings in configured.items()}
    open_staged = {t: int(r[8] or 0) for t, r in rows.items()}
    moving = await flows(conn, slos, open_staged, now, reuse=flow_reuse)
    result = []
    for target in sorted(set(configured) | set(rows)):
        row = rows.get(target)
        state = states.get(target)
        oldest = _utc(row[6]) if row is not None else None
        flow = moving.get(target, Flow())
        settings = configured.get(target)
        queued = sum(int(row[i] or 0) for i in (1, 2, 3)) if row else 0
        paused = bool(state.paused) if state else False
        circuit = _circuit(state, settings, outbox_settings or OutboxSettings(), now)
        # Rows behind an open circuit wait untried, with no error of their own: the circuit's
        # reason is why they wait.
        error = errors.get(target)
        if error is None and circuit == "open" and state is not None:
            error = state.circuit_error
        result.append(
            TargetStatus(
                database=database,
                target=target,
                pending=int(row[1] or 0) if row else 0,
                in_flight=int(row[2] or 0) if row else 0,
                failed=int(row[3] or 0) if row else 0,
                abandoned=int(row[4] or 0) if row else 0,
                published=(int(row[5] or 0) if row else 0) if published else None,
                oldest_claimable_age=round((now - oldest).total_seconds(), 3) if oldest else None,
                retries_per_minute=round(int(row[7] or 0) / 5, 2) if row else 0.0,
                circuit=circuit,
                circuit_since=connections.iso(state.circuit_since) if state else None,
                paused=paused,
                last_error=error,
                staged_per_second=flow.staged_per_second,
                published_per_second=flow.published_per_second,
                time_to_empty_seconds=time_to_empty(queued, flow, paused),
                delivered_within_slo=flow.delivered_within_slo,
                **_limits(settings),
            )
        )
    return result


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
