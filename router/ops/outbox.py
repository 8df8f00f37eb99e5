"""What operators do to an outbox: look (status, trace), replay (requeue), hold (pause),
and tidy (cleanup). Used by the ``router`` commands and the HTTP API.

Every function opens its own connections from the config and works on PostgreSQL, SQLite
and MySQL/MariaDB alike; times are computed here, in UTC, but for the stamps MySQL's watcher
compares (``connections.clock``). Statements differ by dialect only in the upsert of
``set_paused`` and in how ``cleanup`` picks a batch.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from envelopes import ConfigError
from router._schema import OUTBOX, OUTBOX_DONE
from router._wakeup import CHANNEL
from router.config import RouterConfig
from router.ops import connections
from router.ops.audit import record
from router.ops.schema import gaps, inbox, outbox, targets

__all__ = [
    "Cleanup",
    "TraceRow",
    "cleanup",
    "exact_errors",
    "matching_ids",
    "message_id_range",
    "requeue",
    "requeue_rows",
    "set_paused",
    "trace",
    "wake_targets",
]

OPEN = ("pending", "processing", "failed")
RETRY_WINDOW = timedelta(minutes=5)
MIN_PREFIX = 8  # hex digits of a message id that `router trace` takes for the whole
_HEX = re.compile(r"[0-9a-f]+")


@dataclass(frozen=True)
class TraceRow:
    """One target's row of one event."""

    database: str
    target: str
    destination: str
    event_type: str
    status: str
    attempts: int
    last_error: str | None
    locked_by: str | None
    locked_until: str | None
    created_at: str | None
    published_at: str | None
    first_attempt_at: str | None = None
    last_attempt_at: str | None = None
    receipt: dict[str, Any] | None = None
    """Where the broker put the message, as it said when it acknowledged it."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self)


@dataclass(frozen=True)
class Cleanup:
    """What one cleanup removed."""

    database: str
    published: int = 0
    abandoned: int = 0
    inbox: int = 0
    extra: dict[str, int] = field(default_factory=dict)
    gaps: int = 0
    """Gap markers older than the abandoned rows' retention, never named by a message."""


def _receipt(text: str | None) -> dict[str, Any] | None:
    """A stored receipt (a JSON object's text) as a dict; one that does not parse is kept
    whole under ``raw`` rather than hidden."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return {"raw": text}
    return value if isinstance(value, dict) else {"raw": text}


def message_id_range(text: str) -> tuple[str, str]:
    """The lowest and the highest message id that start with ``text``: a message id, or its
    first ``MIN_PREFIX`` hex digits or more, with or without dashes (the console shows the
    first 8). ``ConfigError`` for anything else, before a database sees it."""
    digits = text.strip().lower().replace("-", "")
    if not (MIN_PREFIX <= len(digits) <= 32 and _HEX.fullmatch(digits)):
        raise ConfigError(
            f"{text!r} is not a message id (32 hex digits, dashes optional) nor its first "
            f"{MIN_PREFIX} digits or more"
        )
    return str(uuid.UUID(digits.ljust(32, "0"))), str(uuid.UUID(digits.ljust(32, "f")))


async def matching_ids(config: RouterConfig, text: str, limit: int = 10) -> list[str]:
    """The message ids that start with ``text`` (see ``message_id_range``), in every
    database; at most ``limit`` + 1, so that a caller can tell there are more. A range on
    the id, which its index serves on every database (ids are uuid on PostgreSQL)."""
    low, high = message_id_range(text)
    if low == high:
        return [low]
    found: set[str] = set()
    for name in config.databases:
        async with connections.connect(config, name) as conn:
            query = (
                sa.select(outbox.c.message_id)
                .where(outbox.c.message_id.between(low, high))
                .distinct()
                .order_by(outbox.c.message_id)
                .limit(limit + 1)
            )
            found.update(str(row[0]) for row in (await conn.execute(query)).all())
    return sorted(found)[: limit + 1]


async def trace(config: RouterConfig, message_id: str) -> list[TraceRow]:
    """Every target's row of one event, in every database."""
    found = []
    for name in config.databases:
        async with connections.connect(config, name) as conn:
            query = (
                sa.select(outbox).where(outbox.c.message_id == message_id).order_by(outbox.c.seq)
            )
            for row in (await conn.execute(query)).all():
                found.append(
                    TraceRow(
                        database=name,
                        target=row.target,
                        destination=row.destination,
                        event_type=row.event_type,
                        status=row.status,
                        attempts=row.attempts,
                        last_error=row.last_error,
                        locked_by=row.locked_by,
                        locked_until=connections.iso(row.locked_until),
                        created_at=connections.iso(row.created_at),
                        published_at=connections.iso(row.published_at),
                        first_attempt_at=connections.iso(row.first_attempt_at),
                        last_attempt_at=connections.iso(row.last_attempt_at),
                        receipt=_receipt(row.receipt),
                    )
                )
    return found


async def requeue(
    config: RouterConfig,
    database: str | None = None,
    *,
    targets_: Sequence[str] = (),
    event_types: Sequence[str] = (),
    error: str | None = None,
    errors: Sequence[str | None] | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    statuses: Iterable[str] = ("abandoned",),
    dry_run: bool = False,
    actor: str | None = None,
    context: Mapping[str, Any] | None = None,
) -> dict[str, int]:
    """Put abandoned (or failed) rows back to pending; returns how many, per database.

    ``errors``: only rows whose last error is exactly one of these (a failure group's rows,
    ``router.ops.groups``). ``actor``: who asked, for the audit row written with the change
    (none on a dry run); ``context`` is added to that row's detail.
    """
    connections.check_targets(config, database, targets_)  # before anything is written
    statuses = tuple(statuses)
    conditions = _requeue_conditions(targets_, event_types, error, since, until, statuses)
    filters = {
        "targets": list(targets_),
        "event_types": list(event_types),
        "error": error,
        "since": since,
        "until": until,
        "statuses": list(statuses),
    }
    wheres = [sa.and_(*conditions, part) for part in exact_errors(errors)]
    counts: dict[str, int] = {}
    for name in connections.database_names(config, database):
        atomic = [t for t in config.brokers_of(name) if config.brokers[t].atomic]
        async with connections.connect(config, name) as conn:
            picks = [
                w for where in wheres for w in await whole_units(conn, where, atomic, statuses)
            ]
            if dry_run:
                counts[name] = sum([await _count(conn, where) for where in picks])
                continue
            counts[name], touched = await requeue_rows(conn, picks)
            if actor is not None:
                await record(
                    conn,
                    actor=actor,
                    action="requeue",
                    target=touched[0] if len(touched) == 1 else None,
                    detail={**filters, **(context or {}), "database": name, "touched": touched},
                    row_count=counts[name],
                )
    return counts


def _requeue_conditions(
    targets: Sequence[str],
    event_types: Sequence[str],
    error: str | None,
    since: datetime | None,
    until: datetime | None,
    statuses: Sequence[str],
) -> list[sa.ColumnElement[bool]]:
    o = outbox
    conditions: list[sa.ColumnElement[bool]] = [o.c.status.in_(tuple(statuses))]
    if targets:
        conditions.append(o.c.target.in_(tuple(targets)))
    if event_types:
        conditions.append(o.c.event_type.in_(tuple(event_types)))
    if error:
        conditions.append(sa.func.lower(o.c.last_error).contains(error.lower(), autoescape=True))
    if since is not None:
        conditions.append(o.c.created_at >= since.astimezone(UTC))
    if until is not None:
        conditions.append(o.c.created_at < until.astimezone(UTC))
    return conditions


# Values per IN list: SQLite binds at most 32,766 parameters in one statement (999 before
# 3.32), and a failure group may hold thousands of distinct texts.
EXACT_CHUNK = 500


def exact_errors(errors: Sequence[str | None] | None) -> list[sa.ColumnElement[bool]]:
    """Conditions that together pick the rows whose last error is one of ``errors`` (one
    per chunk of the list; None matches no error); ``[true]`` when ``errors`` is None."""
    if errors is None:
        return [sa.true()]
    column = outbox.c.last_error
    texts = sorted({e for e in errors if e is not None})
    parts: list[sa.ColumnElement[bool]] = [
        column.in_(texts[i : i + EXACT_CHUNK]) for i in range(0, len(texts), EXACT_CHUNK)
    ]
    if None in errors:
        parts.append(column.is_(None))
    return parts


# The rows of an atomic target's unit, read apart from ``outbox`` (which does not declare
# ``xid``: PostgreSQL's is xid8, and every ``select(outbox)`` would read it).
_MEMBERS = sa.table(
    OUTBOX, sa.column("seq"), sa.column("target"), sa.column("status"), sa.column("xid")
).alias("member")
_XID: sa.ColumnElement[Any] = sa.literal_column(f"{OUTBOX}.xid")


async def whole_units(
    conn: AsyncConnection,
    where: sa.ColumnElement[bool],
    atomic: Sequence[str],
    statuses: Sequence[str],
) -> list[sa.ColumnElement[bool]]:
    """``where`` and, when it picks part of a unit of an atomic target (its application
    transaction's rows), conditions picking the unit's other members in ``statuses``.

    A unit goes whole or not at all, and takes one verdict: requeuing some of its members
    (by event type, say) brings the others back with them, where the relay would otherwise
    send the part alone, as a unit of its own. One read; nothing more when ``where`` already
    holds whole units, as a failure group or an error filter does."""
    if not atomic:
        return [where]
    o, m = outbox, _MEMBERS
    picked = sa.select(o.c.target, _XID).where(where, o.c.target.in_(atomic), _XID.is_not(None))
    others = sa.select(m.c.seq).where(
        sa.tuple_(m.c.target, m.c.xid).in_(picked),
        m.c.status.in_(tuple(statuses)),
        m.c.seq.not_in(sa.select(o.c.seq).where(where)),
    )
    seqs = sorted(r[0] for r in await conn.execute(others))
    return [where] + [
        sa.and_(o.c.seq.in_(seqs[i : i + EXACT_CHUNK]), o.c.status.in_(tuple(statuses)))
        for i in range(0, len(seqs), EXACT_CHUNK)
    ]


async def _count(conn: AsyncConnection, where: sa.ColumnElement[bool]) -> int:
    query = sa.select(sa.func.count()).select_from(outbox).where(where)
    return int((await conn.execute(query)).scalar_one())


async def requeue_rows(
    conn: AsyncConnection, wheres: Sequence[sa.ColumnElement[bool]]
) -> tuple[int, list[str]]:
    """Back to pending, attempts reset, due now; returns (rows changed, their targets). An
    abandoned row's gap marker goes with it: it will be delivered, so nothing is missing."""
    o = outbox
    changed, touched = 0, set[str]()
    for where in wheres:
        found = await conn.execute(sa.select(o.c.target).where(where).distinct())
        touched.update(r[0] for r in found)
        await conn.execute(_delete_gaps_of(where))
        result = await conn.execute(
            sa.update(o)
            .where(where)
            .values(
                status="pending",
                attempts=0,
                available_at=connections.clock(conn),
                locked_by=None,
                locked_until=None,
                lease_token=None,
            )
        )
        changed += result.rowcount or 0
    if touched:
        await wake_targets(conn, sorted(touched))
    return changed, sorted(touched)


def _delete_gaps_of(where: sa.ColumnElement[bool]) -> Any:
    """DELETE the gap markers of the abandoned rows ``where`` picks, by router_gaps' primary
    key (target, stream key, seq)."""
    o = outbox
    rows = sa.select(o.c.target, o.c.stream_key, o.c.seq).where(
        where, o.c.status == "abandoned", o.c.stream_key.is_not(None)
    )
    key = sa.tuple_(gaps.c.target, gaps.c.stream_key, gaps.c.seq)
    return sa.delete(gaps).where(key.in_(rows))


async def set_paused(
    config: RouterConfig,
    target: str,
    *,
    paused: bool,
    database: str | None = None,
    by: str | None = None,
    actor: str | None = None,
) -> list[str]:
    """Pause or resume a target in every database that publishes to it; ``actor``: who
    asked, for the audit row written with the change."""
    connections.check_targets(config, database, [target])
    changed = []
    for name in connections.database_names(config, database):
        if target not in config.brokers_of(name):
            continue
        async with connections.connect(config, name) as conn:
            values = {
                "paused": paused,
                "paused_at": connections.clock(conn) if paused else None,
                "paused_by": by if paused else None,
            }
            await conn.execute(_upsert_target(conn.dialect.name, target, values))
            # A resume wakes the target's processors to deliver; a pause wakes them too, so
            # that an idle one gives back its wake lock (PostgreSQL): a paused target's
            # stagers need not notify.
            await wake_targets(conn, [target])
            if actor is not None:
                await record(
                    conn,
                    actor=actor,
                    action="pause" if paused else "resume",
                    target=target,
                    detail={"database": name},
                    row_count=1,
                )
        changed.append(name)
    return changed


def _upsert_target(dialect: str, target: str, values: dict[str, Any]) -> Any:
    """INSERT ``target``'s row into router_targets, or UPDATE ``values`` on the row there."""
    if dialect == "mysql":
        row = mysql.insert(targets).values(target=target, circuit="closed", **values)
        return row.on_duplicate_key_update(values)
    insert = (postgresql if dialect == "postgresql" else sqlite).insert
    row = insert(targets).values(target=target, circuit="closed", **values)
    return row.on_conflict_do_update(index_elements=[targets.c.target], set_=values)


async def cleanup(
    config: RouterConfig, database: str | None = None, *, batch_size: int | None = None
) -> list[Cleanup]:
    """Delete published and abandoned rows past their retention, in bounded batches."""
    retention = config.outbox.retention
    size = batch_size or retention.batch_size
    done = []
    for name in connections.database_names(config, database):
        now = connections.now()
        async with connections.engine(config, name) as engine:
            published = await _delete_older(
                engine, "published", outbox.c.published_at, now - retention.published, size
            )
            abandoned = await _delete_older(
                engine, "abandoned", outbox.c.last_attempt_at, now - retention.abandoned, size
            )
            records = await _delete_inbox(engine, now - retention.inbox, size)
            old_gaps = await _delete_gaps(engine, now - retention.abandoned, size)
            if published or abandoned:
                await _vacuum_history(engine)
        done.append(Cleanup(name, published, abandoned, records, gaps=old_gaps))
    return done


async def _vacuum_history(engine: AsyncEngine) -> None:
    """VACUUM the PostgreSQL history the cleanup deleted from, so that its space is used
    again whether or not autovacuum is on: the router's own VACUUM reads the queue alone.
    A role that may not vacuum the table gets a warning from the server, not an error."""
    if engine.dialect.name != "postgresql":
        return
    async with engine.connect() as conn:
        # VACUUM cannot run inside a transaction block.
        autocommit = await conn.execution_options(isolation_level="AUTOCOMMIT")
        await autocommit.exec_driver_sql(f"VACUUM (SKIP_LOCKED) {OUTBOX_DONE}")


def cleanup_batch(status_: str, column: Any, cutoff: datetime, size: int) -> Any:
    """The keys (``seq``) of one batch of rows of ``status_`` whose ``column`` is before
    ``cutoff``, oldest first: a range of the retention index, which holds all it reads."""
    o = outbox
    return (
        sa.select(o.c.seq)
        .where(o.c.status == status_, column < cutoff)
        .order_by(column)
        .limit(size)
    )


def cleanup_statement(status_: str, column: Any, cutoff: datetime, size: int) -> Any:
    """DELETE one batch of rows of ``status_`` whose ``column`` is before ``cutoff``
    (PostgreSQL and SQLite)."""
    batch = cleanup_batch(status_, column, cutoff, size).scalar_subquery()
    return sa.delete(outbox).where(outbox.c.seq.in_(batch))


def cleanup_by_key(status_: str, column: Any, cutoff: datetime, seqs: Sequence[int]) -> Any:
    """DELETE the rows ``seqs`` that are still ``status_`` and before ``cutoff`` (MySQL)."""
    o = outbox
    return sa.delete(o).where(o.c.seq.in_(seqs), o.c.status == status_, column < cutoff)


async def _delete_older(
    engine: AsyncEngine, status_: str, column: Any, cutoff: datetime, size: int
) -> int:
    total = 0
    while True:
        # One transaction per batch: locks stay short on a busy outbox.
        async with engine.begin() as conn:
            if conn.dialect.name == "mysql":
                seen, deleted = await _delete_by_key(conn, status_, column, cutoff, size)
            else:
                result = await conn.execute(cleanup_statement(status_, column, cutoff, size))
                seen = deleted = result.rowcount or 0
        total += deleted
        if seen < size:
            return total


async def _delete_by_key(
    conn: AsyncConnection, status_: str, column: Any, cutoff: datetime, size: int
) -> tuple[int, int]:
    """One batch on MySQL, which refuses a LIMIT in an IN subquery (error 1235) and, given
    a derived table there instead, reads the whole outbox for the DELETE: the batch's keys
    first, read off the retention index without locking anything, then a DELETE of those
    rows by primary key, which locks only them. The DELETE checks the status and time again,
    so a row requeued in between stays. Returns (rows picked, rows deleted)."""
    seqs = list((await conn.execute(cleanup_batch(status_, column, cutoff, size))).scalars())
    if not seqs:
        return 0, 0
    result = await conn.execute(cleanup_by_key(status_, column, cutoff, seqs))
    return len(seqs), result.rowcount or 0


async def _delete_inbox(engine: AsyncEngine, cutoff: datetime, size: int) -> int:
    """Dedup records older than the inbox window, in batches (through their time index)."""
    total = 0
    while True:
        batch = (
            sa.select(inbox.c.consumer, inbox.c.message_id)
            .where(inbox.c.received_at < cutoff)
            .order_by(inbox.c.received_at)
            .limit(size)
        )
        async with engine.begin() as conn:
            keys = (await conn.execute(batch)).all()
            if keys:
                await conn.execute(
                    sa.delete(inbox).where(
                        sa.tuple_(inbox.c.consumer, inbox.c.message_id).in_(
                            [tuple(k) for k in keys]
                        )
                    )
                )
        total += len(keys)
        if len(keys) < size:
            return total


async def _delete_gaps(engine: AsyncEngine, cutoff: datetime, size: int) -> int:
    """Gap markers recorded before ``cutoff`` (the abandoned rows' retention), in batches by
    their time index: a stream that has carried no message since keeps its gap that long."""
    g = gaps
    key = (g.c.target, g.c.stream_key, g.c.seq)
    total = 0
    while True:
        batch = sa.select(*key).where(g.c.abandoned_at < cutoff).order_by(g.c.abandoned_at)
        async with engine.begin() as conn:
            keys = [tuple(k) for k in (await conn.execute(batch.limit(size))).all()]
            if keys:
                await conn.execute(sa.delete(g).where(sa.tuple_(*key).in_(keys)))
        total += len(keys)
        if len(keys) < size:
            return total


async def wake_targets(conn: AsyncConnection, target_names: Sequence[str]) -> None:
    """Wake the processors of these targets once the transaction commits.

    Only PostgreSQL needs a word: SQLite's watcher sees the file change, and MySQL's sees the
    newest pending ``available_at`` rise or the paused targets change (``connections.clock``).
    """
    if conn.dialect.name == "postgresql":
        await conn.execute(sa.select(sa.func.pg_notify(CHANNEL, ",".join(sorted(target_names)))))
