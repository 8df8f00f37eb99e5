"""Failure groups: the failed and abandoned rows of an outbox, grouped by what went wrong
(with the held and parked stream heads, which ``router release --group`` lets go).

A group is (database, target, error class, broker error code, normalised message): the rows
of one target that failed the same way, whatever their event, time, id or attempt count.
``router groups`` lists them; ``router requeue --group`` and ``router discard --group`` act
on exactly one group's failed and abandoned rows, ``router release --group`` on the held and
parked keys whose head is one of its rows.

The database groups the rows by their exact ``last_error`` (so nothing loads every row);
``signature`` then normalises each distinct text and the groups with equal signatures merge.
A group keeps the exact texts it is made of, which is how its rows are found again.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from router.config import RouterConfig
from router.ops import connections
from router.ops.audit import record
from router.ops.error_text import Signature, signature
from router.ops.outbox import exact_errors, requeue
from router.ops.schema import outbox
from router.ops.times import utc as _utc

__all__ = [
    "FailureGroup",
    "Sample",
    "discard",
    "find_group",
    "group_id",
    "list_groups",
    "requeue_group",
]

FAILED = ("failed", "abandoned")
# Listed with their group too: held and parked stream heads (a target's ``ordering``), which
# ``router release --group`` lets go. Requeue and discard act on FAILED rows alone.
LISTED = (*FAILED, "held", "parked")
DISCARD_BATCH = 1000
AUDITED_IDS = 100


@dataclass(frozen=True)
class Sample:
    """The group's oldest row."""

    seq: int
    message_id: str
    last_error: str | None


@dataclass(frozen=True)
class FailureGroup:
    """Failed and abandoned rows of one target that failed the same way (and held or parked
    ones: ``statuses`` names those only when there are some)."""

    id: str
    database: str
    target: str
    error_class: str
    code: str | None
    message: str
    statuses: dict[str, int]
    count: int
    first_seen: str | None
    last_seen: str | None
    sample: Sample
    errors: tuple[str | None, ...] = field(repr=False)
    """The exact ``last_error`` texts of the group's rows."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (without the exact texts, which may be many)."""
        document = asdict(self)
        del document["errors"]
        return document


def group_id(database: str, target: str, sig: Signature) -> str:
    """A short id that stays the same while the group's rows stay (10 hex digits)."""
    key = "\x1f".join((database, target, sig.error_class, sig.code or "", sig.message))
    return hashlib.sha256(key.encode()).hexdigest()[:10]


async def list_groups(
    config: RouterConfig, database: str | None = None, target: str | None = None
) -> list[FailureGroup]:
    """Every failure group, the most recently seen first."""
    if target is not None:
        connections.check_targets(config, database, [target])
    found: list[FailureGroup] = []
    for name in connections.database_names(config, database):
        async with connections.connect(config, name) as conn:
            found.extend(await _groups_of(conn, name, target))
    found.sort(key=lambda g: (g.last_seen or "", g.count), reverse=True)
    return found


async def find_group(
    config: RouterConfig, group: str, database: str | None = None
) -> FailureGroup | None:
    """The group with id ``group``, or None."""
    for name in connections.database_names(config, database):
        async with connections.connect(config, name) as conn:
            for found in await _groups_of(conn, name, None):
                if found.id == group:
                    return found
    return None


@dataclass
class _Merging:
    """One group as the rows of its distinct texts add up."""

    target: str
    sig: Signature
    statuses: dict[str, int] = field(default_factory=dict)
    first: datetime | None = None
    last: datetime | None = None
    sample: tuple[int, str | None] | None = None
    errors: set[str | None] = field(default_factory=set)

    def add(self, row: Any) -> None:
        self.statuses[row.status] = self.statuses.get(row.status, 0) + int(row.rows)
        first, last = _utc(row.first), _utc(row.last)
        if first is not None and (self.first is None or first < self.first):
            self.first = first
        if last is not None and (self.last is None or last > self.last):
            self.last = last
        if self.sample is None or row.sample < self.sample[0]:
            self.sample = (int(row.sample), row.last_error)
        self.errors.add(row.last_error)


async def _groups_of(
    conn: AsyncConnection, database: str, target: str | None
) -> list[FailureGroup]:
    o = outbox
    time = o.c.last_attempt_at.type
    query = (
        sa.select(
            o.c.target,
            o.c.status,
            o.c.last_error,
            sa.func.count().label("rows"),
            sa.type_coerce(sa.func.min(o.c.last_attempt_at), time).label("first"),
            sa.type_coerce(sa.func.max(o.c.last_attempt_at), time).label("last"),
            sa.func.min(o.c.seq).label("sample"),
        )
        .where(o.c.status.in_(LISTED))
        .group_by(o.c.target, o.c.status, o.c.last_error)
    )
    if target is not None:
        query = query.where(o.c.target == target)
    merged: dict[tuple[str, Signature], _Merging] = {}
    for row in await conn.execute(query):
        sig = signature(row.last_error)
        merged.setdefault((row.target, sig), _Merging(row.target, sig)).add(row)
    ids = await _message_ids(conn, [m.sample[0] for m in merged.values() if m.sample])
    return [_group(database, m, ids) for m in merged.values()]


async def _message_ids(conn: AsyncConnection, seqs: list[int]) -> dict[int, str]:
    found: dict[int, str] = {}
    for i in range(0, len(seqs), DISCARD_BATCH):
        query = sa.select(outbox.c.seq, outbox.c.message_id).where(
            outbox.c.seq.in_(seqs[i : i + DISCARD_BATCH])
        )
        found.update((int(r.seq), str(r.message_id)) for r in await conn.execute(query))
    return found


def _group(database: str, merging: _Merging, ids: dict[int, str]) -> FailureGroup:
    seq, error = merging.sample or (0, None)
    sig = merging.sig
    return FailureGroup(
        id=group_id(database, merging.target, sig),
        database=database,
        target=merging.target,
        error_class=sig.error_class,
        code=sig.code,
        message=sig.message,
        statuses={
            status: merging.statuses.get(status, 0)
            for status in LISTED
            if status in FAILED or merging.statuses.get(status)
        },
        count=sum(merging.statuses.values()),
        first_seen=connections.iso(merging.first),
        last_seen=connections.iso(merging.last),
        sample=Sample(seq, ids.get(seq, ""), error),
        errors=tuple(sorted(merging.errors, key=lambda e: (e is None, e or ""))),
    )


def _context(group: FailureGroup) -> dict[str, Any]:
    """What an audit row says of the group it acted on."""
    return {
        "group": group.id,
        "target": group.target,
        "error_class": group.error_class,
        "code": group.code,
        "message": group.message,
    }


async def requeue_group(
    config: RouterConfig, group: FailureGroup, *, dry_run: bool = False, actor: str | None = None
) -> int:
    """Put the group's rows back to pending (``router.ops.outbox.requeue``)."""
    counts = await requeue(
        config,
        group.database,
        targets_=[group.target],
        statuses=FAILED,
        errors=group.errors,
        dry_run=dry_run,
        actor=actor,
        context=_context(group),
    )
    return counts.get(group.database, 0)


async def discard(
    config: RouterConfig,
    group: FailureGroup,
    *,
    dry_run: bool = False,
    actor: str | None = None,
    batch_size: int = DISCARD_BATCH,
) -> int:
    """Delete the group's rows: they will never be sent. Returns how many.

    The rows go in batches by primary key, each DELETE checking the row is still failed
    with one of the group's texts (a row retried meanwhile stays), all in one transaction
    with the audit row: a discard that stops half-way leaves nothing deleted unaudited.
    """
    o = outbox
    wheres = [
        sa.and_(o.c.target == group.target, o.c.status.in_(FAILED), part)
        for part in exact_errors(group.errors)
    ]
    async with connections.connect(config, group.database) as conn:
        if dry_run:
            query = sa.select(sa.func.count()).select_from(o)
            return sum([int((await conn.execute(query.where(w))).scalar_one()) for w in wheres])
        deleted = 0
        message_ids: list[str] = []
        for where in wheres:
            done, ids = await _delete_batches(conn, where, batch_size)
            deleted += done
            message_ids.extend(ids[: AUDITED_IDS - len(message_ids)])
        if actor is not None:
            detail = {**_context(group), "database": group.database, "message_ids": message_ids}
            await record(
                conn,
                actor=actor,
                action="discard",
                target=group.target,
                detail=detail,
                row_count=deleted,
            )
    return deleted


async def _delete_batches(
    conn: AsyncConnection, where: sa.ColumnElement[bool], size: int
) -> tuple[int, list[str]]:
    """Delete the rows ``where`` picks, ``size`` keys at a time in ``seq`` order (so a row
    that changed meanwhile and stays is not picked again); (rows deleted, their first
    message ids)."""
    o = outbox
    deleted, after = 0, -1
    message_ids: list[str] = []
    while True:
        query = sa.select(o.c.seq, o.c.message_id).where(where, o.c.seq > after)
        batch = (await conn.execute(query.order_by(o.c.seq).limit(size))).all()
        if not batch:
            return deleted, message_ids
        seqs = [int(r.seq) for r in batch]
        result = await conn.execute(sa.delete(o).where(o.c.seq.in_(seqs), where))
        deleted += result.rowcount or 0
        if len(message_ids) < AUDITED_IDS:
            message_ids.extend(str(r.message_id) for r in batch[: AUDITED_IDS - len(message_ids)])
        after = seqs[-1]
        if len(batch) < size:
            return deleted, message_ids
