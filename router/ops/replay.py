"""Replay and backfill: send retained events to one target again, at a paced rate.

- **Replay** puts a target's own published rows (kept for ``retention.published``) back in
  its queue. They go out again with their original message ids, so broker-side dedup and the
  consumers' inboxes recognise them; no other target's rows are touched.
- **Backfill** brings a new target up to date: every event retained in the database for any
  other target, that this target would have been sent had it been configured then, gets a
  row for it (the stored envelope, the target's own destination). It needs the event
  classes (the config's ``events:`` modules), because routing is theirs to decide.

Both work in batches in outbox order, paced to ``rate`` rows a second, one transaction per
batch, and write an audit row when they start (everything needed to resume) and when they
finish. Both resume after a crash: a replay takes only rows published before it started
(a row it already put back is queued, or published again since), and a backfill only
events the target has no row for yet.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from envelopes import ConfigError
from router.config import RouterConfig
from router.ops import audit, connections
from router.ops.outbox import requeue_rows
from router.ops.schema import audit as audit_table
from router.ops.schema import outbox
from router.write.async_drivers import async_driver, insert
from router.write.catalog import EventCatalog, load_catalog
from router.write.staging import Row, Stager

__all__ = ["Progress", "ReplayPlan", "replay", "resume_plan"]

# Rows per batch at most; at a given rate, batches are smaller (20 a second) so the pace
# is even rather than bursty.
MAX_BATCH = 500
BATCHES_PER_SECOND = 20


@dataclass(frozen=True)
class ReplayPlan:
    """What to send again, where, and how fast."""

    database: str
    target: str
    backfill: bool = False
    since: datetime | None = None
    until: datetime | None = None
    event_types: tuple[str, ...] = ()
    rate: float | None = None
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))

    def as_detail(self) -> dict[str, Any]:
        """What the audit row keeps, enough to resume."""
        detail = asdict(self)
        for key in ("since", "until", "started_at"):
            value = detail[key]
            detail[key] = value.isoformat() if value is not None else None
        detail["event_types"] = list(self.event_types)
        return detail

    @classmethod
    def from_detail(cls, detail: dict[str, Any]) -> ReplayPlan:
        """The plan an audit row recorded."""

        def moment(key: str) -> datetime | None:
            value = detail.get(key)
            return datetime.fromisoformat(value) if value else None

        started = moment("started_at")
        assert started is not None
        return cls(
            database=detail["database"],
            target=detail["target"],
            backfill=bool(detail.get("backfill")),
            since=moment("since"),
            until=moment("until"),
            event_types=tuple(detail.get("event_types") or ()),
            rate=detail.get("rate"),
            started_at=started,
        )


@dataclass
class Progress:
    """How far a replay got."""

    total: int
    done: int = 0
    skipped: int = 0  # backfill: retained events the target would not have been sent
    elapsed: float = 0.0
    audit_id: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self)


Report = Callable[[Progress], None]


def _check(config: RouterConfig, plan: ReplayPlan) -> None:
    connections.check_targets(config, plan.database, [plan.target])
    if plan.rate is not None and plan.rate <= 0:
        raise ConfigError("--rate must be above 0")


def _filters(plan: ReplayPlan) -> list[sa.ColumnElement[bool]]:
    o = outbox
    found: list[sa.ColumnElement[bool]] = []
    if plan.since is not None:
        found.append(o.c.created_at >= plan.since.astimezone(UTC))
    if plan.until is not None:
        found.append(o.c.created_at < plan.until.astimezone(UTC))
    if plan.event_types:
        found.append(o.c.event_type.in_(plan.event_types))
    return found


def _replayable(plan: ReplayPlan) -> sa.ColumnElement[bool]:
    """The target's rows a replay still has to put back: published before it started."""
    o = outbox
    return sa.and_(
        o.c.target == plan.target,
        o.c.status == "published",
        o.c.published_at < plan.started_at.astimezone(UTC),
        *_filters(plan),
    )


def _not_yet_backfilled(plan: ReplayPlan) -> sa.ColumnElement[bool]:
    """Other targets' rows of events this target has no row for."""
    o, mine = outbox, outbox.alias("mine")
    has_row = sa.exists().where(mine.c.message_id == o.c.message_id, mine.c.target == plan.target)
    return sa.and_(o.c.target != plan.target, ~has_row, *_filters(plan))


class _Pace:
    """Batches spaced so that rows go in at ``rate`` a second, measured from the start."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self.batch = (
            MAX_BATCH if rate is None else max(1, min(MAX_BATCH, int(rate) // BATCHES_PER_SECOND))
        )
        self.start = time.monotonic()
        self.sent = 0

    async def wait(self) -> None:
        if self.rate is not None:
            delay = self.start + self.sent / self.rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)

    def count(self, rows: int) -> None:
        self.sent += rows

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start


@dataclass
class _Cursor:
    """Where the batches are in outbox order, and the events a backfill passed over."""

    after: int = 0
    passed: set[str] = field(default_factory=set)


async def replay(
    config: RouterConfig,
    plan: ReplayPlan,
    *,
    actor: str,
    dry_run: bool = False,
    report: Report | None = None,
    resumed_from: int | None = None,
) -> Progress:
    """Run ``plan``; ``report`` is called after every batch. Raises ConfigError for a plan
    that names an unknown database or target, or a backfill without event classes."""
    _check(config, plan)
    catalog = _catalog(config) if plan.backfill else EventCatalog()
    stager = Stager(config)
    action = "backfill" if plan.backfill else "replay"
    async with connections.engine(config, plan.database) as engine, engine.connect() as conn:
        async with conn.begin():
            if plan.backfill:
                total = await _count_backfill(conn, plan, stager, catalog)
            else:
                total = await _count_replay(conn, plan)
            progress = Progress(total=total)
            if dry_run:
                return progress
            detail = {**plan.as_detail(), "resumed_from": resumed_from}
            progress.audit_id = await audit.record(
                conn,
                actor=actor,
                action=action,
                target=plan.target,
                detail=detail,
                row_count=total,
            )
        pace = _Pace(plan.rate)
        cursor = _Cursor()
        while True:
            await pace.wait()
            async with conn.begin():
                if plan.backfill:
                    found, done, skipped = await _backfill_batch(
                        conn, plan, pace.batch, cursor, stager, catalog
                    )
                else:
                    found, done, skipped = await _replay_batch(conn, plan, pace.batch, cursor)
            if not found:
                break
            pace.count(done)
            progress.done += done
            progress.skipped += skipped
            progress.elapsed = pace.elapsed
            if report is not None:
                report(progress)
        progress.elapsed = pace.elapsed
        async with conn.begin():
            await audit.record(
                conn,
                actor=actor,
                action=f"{action}-finished",
                target=plan.target,
                detail={"of": progress.audit_id, "seconds": round(progress.elapsed, 3)},
                row_count=progress.done,
            )
    return progress


async def resume_plan(config: RouterConfig, database: str, audit_id: int) -> ReplayPlan:
    """The plan of the replay or backfill that audit row ``audit_id`` started."""
    connections.database_names(config, database)  # ConfigError naming them if unknown
    async with connections.connect(config, database) as conn:
        row = (
            await conn.execute(sa.select(audit_table).where(audit_table.c.id == audit_id))
        ).first()
    if row is None or row.action not in ("replay", "backfill"):
        raise ConfigError(f"audit row {audit_id} in {database!r} did not start a replay")
    return ReplayPlan.from_detail(orjson.loads(row.detail or "{}"))


async def _count_replay(conn: AsyncConnection, plan: ReplayPlan) -> int:
    query = sa.select(sa.func.count()).select_from(outbox).where(_replayable(plan))
    return int((await conn.execute(query)).scalar_one())


async def _replay_batch(
    conn: AsyncConnection, plan: ReplayPlan, size: int, cursor: _Cursor
) -> tuple[int, int, int]:
    """The next ``size`` rows in outbox order back to pending; (found, done, 0)."""
    o = outbox
    query = sa.select(o.c.seq).where(_replayable(plan), o.c.seq > cursor.after)
    seqs = [r[0] for r in (await conn.execute(query.order_by(o.c.seq).limit(size))).all()]
    if not seqs:
        return 0, 0, 0
    cursor.after = seqs[-1]
    # Fenced by 'published' (in _replayable): a row put back meanwhile is not counted twice.
    done, _ = await requeue_rows(conn, [sa.and_(o.c.seq.in_(seqs), _replayable(plan))])
    return len(seqs), done, 0


def _catalog(config: RouterConfig) -> EventCatalog:
    if not config.events:
        raise ConfigError(
            "a backfill needs the event classes to know which events the target takes: "
            "list their modules under events: in the config"
        )
    return load_catalog(config.events, config.base_dir)


def _route(
    plan: ReplayPlan, stager: Stager, catalog: EventCatalog, event_type: str, version: int | None
) -> str | None:
    """The target's destination for an event, or None when the target does not take it."""
    try:
        event_class = catalog.get(event_type, version)
    except ConfigError:
        return None  # a type the catalog does not know: routing cannot be decided
    for route in stager.routes(plan.database, event_class):
        if route.target == plan.target:
            return route.destination
    return None


async def _count_backfill(
    conn: AsyncConnection, plan: ReplayPlan, stager: Stager, catalog: EventCatalog
) -> int:
    """Events to copy: per type, distinct message ids the target has no row for, counted
    for the types the target takes."""
    o = outbox
    query = (
        sa.select(o.c.event_type, sa.func.count(sa.distinct(o.c.message_id)))
        .where(_not_yet_backfilled(plan))
        .group_by(o.c.event_type)
    )
    total = 0
    for event_type, count in (await conn.execute(query)).all():
        if _route(plan, stager, catalog, event_type, None) is not None:
            total += int(count)
    return total


async def _backfill_batch(
    conn: AsyncConnection,
    plan: ReplayPlan,
    size: int,
    cursor: _Cursor,
    stager: Stager,
    catalog: EventCatalog,
) -> tuple[int, int, int]:
    """Rows for the next events in outbox order: (source rows read, rows written, events
    the target does not take). Staging's insert writes them: per-stream order locks and the
    wake-up included."""
    o = outbox
    columns = (o.c.seq, o.c.message_id, o.c.event_type, o.c.stream_key, o.c.envelope)
    query = sa.select(*columns).where(_not_yet_backfilled(plan), o.c.seq > cursor.after)
    found = (await conn.execute(query.order_by(o.c.seq).limit(size))).all()
    if not found:
        return 0, 0, 0
    if len(cursor.passed) > 10_000:  # an event's rows are adjacent: old ones are past
        cursor.passed.clear()
    rows: dict[str, Row] = {}
    skipped = 0
    for seq, message_id, event_type, stream_key, envelope in found:
        cursor.after = seq
        message_id = str(message_id)
        if message_id in rows or message_id in cursor.passed:
            continue
        text = envelope if isinstance(envelope, str) else orjson.dumps(envelope).decode()
        destination = _route(plan, stager, catalog, event_type, orjson.loads(text).get("version"))
        if destination is None:
            cursor.passed.add(message_id)
            skipped += 1
            continue
        rows[message_id] = Row(message_id, plan.target, destination, event_type, stream_key, text)
    if rows:
        driver = await async_driver(conn)
        await insert(driver, stager.statements(driver.dialect, list(rows.values())))
    return len(found), len(rows), skipped
