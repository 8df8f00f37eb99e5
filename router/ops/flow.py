"""How a target's queue moves: rows staged and published a second over the last minute, the
share delivered within the target's ``slo_seconds``, and when the queue will be empty at that
pace. Read from the database, so every process (``router status``, the console, /metrics)
tells the same story whichever worker delivered.

Rows published in the window come from ``ix_router_outbox_published`` (a range of the last
minute); rows staged in the window that are still open are counted by the status query's own
pass over the open rows (``open_staged``), so this adds one index range scan.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from router.ops.schema import outbox
from router.ops.times import utc as _utc

__all__ = ["WINDOW", "Flow", "flows", "time_to_empty"]

WINDOW = timedelta(seconds=60)


@dataclass(frozen=True)
class Flow:
    """One target's last minute."""

    staged_per_second: float = 0.0
    published_per_second: float = 0.0
    delivered_within_slo: float | None = None  # share of the rows published; None: none were


def _seconds_between(dialect: str, start: Any, end: Any) -> Any:
    """``end - start`` in seconds, as each database spells it."""
    if dialect == "postgresql":
        return sa.func.extract("epoch", end - start)
    if dialect == "mysql":
        return sa.func.timestampdiff(sa.text("MICROSECOND"), start, end) / 1_000_000.0
    return (sa.func.julianday(end) - sa.func.julianday(start)) * 86_400.0


# The published rows of the window, per database, when last read: (read at, rows by target).
_published: dict[str, tuple[datetime, dict[str, tuple[Any, ...]]]] = {}


async def flows(
    conn: AsyncConnection,
    slos: dict[str, float],
    open_staged: dict[str, int],
    now: datetime,
    reuse: float = 0.0,
) -> dict[str, Flow]:
    """Per target: the last minute's flow. ``open_staged``: rows staged in the window that are
    not finished yet (the published ones are counted here). ``reuse``: seconds a reading of
    the published rows may be reused (the console polls every second, and on a busy target
    the window holds hundreds of thousands of rows; a minute's pace moves slowly)."""
    key = str(conn.engine.url)
    cached = _published.get(key)
    if cached is not None and (now - cached[0]).total_seconds() < reuse:
        published = cached[1]
    else:
        published = await _published_in_window(conn, slos, now)
        _published[key] = (now, published)
    window = WINDOW.total_seconds()
    found: dict[str, Flow] = {}
    for target in set(published) | set(open_staged):
        row = published.get(target)
        done, within, staged, span = 0, 0, open_staged.get(target, 0), window
        if row is not None:
            done, within = int(row[1]), int(row[2] or 0)
            staged += int(row[3] or 0)
            # A target that began publishing within the window is measured over the time
            # since its first publish in it, not the whole minute, or a fresh drain would
            # look slow.
            first = _utc(row[4])
            if first is not None:
                span = min(window, max(1.0, (now - first).total_seconds()))
        found[target] = Flow(
            staged_per_second=round(staged / window, 2),
            published_per_second=round(done / span, 2),
            delivered_within_slo=round(within / done, 4) if done else None,
        )
    return found


async def _published_in_window(
    conn: AsyncConnection, slos: dict[str, float], now: datetime
) -> dict[str, tuple[Any, ...]]:
    """Per target: (target, rows published in the window, of them within the SLO, of them
    staged in the window, the window's first publish)."""
    o = outbox
    since = now - WINDOW
    took = _seconds_between(conn.dialect.name, o.c.created_at, o.c.published_at)
    slo = sa.case(slos, value=o.c.target, else_=1.0) if slos else sa.literal(1.0)

    def count(condition: Any) -> Any:
        return sa.func.sum(sa.case((condition, 1), else_=0))

    query = (
        sa.select(
            o.c.target,
            sa.func.count(),
            count(took <= slo),
            count(o.c.created_at > since),
            sa.type_coerce(sa.func.min(o.c.published_at), o.c.published_at.type),
        )
        .where(o.c.status == "published", o.c.published_at > since)
        .group_by(o.c.target)
    )
    return {r[0]: tuple(r) for r in (await conn.execute(query)).all()}


def time_to_empty(queued: int, flow: Flow, paused: bool) -> float | None:
    """Seconds until the queue is empty at the last minute's pace: 0 when it is; None when it
    is not shrinking (paused, stalled, or filling faster than it drains)."""
    if queued == 0:
        return 0.0
    net = flow.published_per_second - flow.staged_per_second
    if paused or net <= 0:
        return None
    return round(queued / net, 1)
