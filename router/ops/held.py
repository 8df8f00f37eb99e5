"""Held and parked stream keys, for operators: ``router held`` lists them, ``router release``
lets one go, or every one whose head failed the way a failure group's rows did.

A target whose ``ordering`` is ``hold`` keeps a stream's head it gave up on (refused for good,
or out of attempts) as ``held``; one whose ordering is ``park`` sets it aside, ``parked``,
with every later row of its stream on the target. Either way the key waits, untried, until an
operator releases it:

- retry (the default): the head back to pending, its attempts counted afresh, and a parked
  key's other rows back to pending too; the key is then delivered in order, head first. A
  head that still fails is held (or parked) again once its attempts run out;
- drop: the head abandoned, its gap recorded as ``skip`` would have (the next message
  delivered on the key names it), and the rest back to pending.

Each release is one transaction per database with its audit row (who, why, which key and
head), and wakes a running relay as ``router requeue`` does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from envelopes import ConfigError
from router.config import RouterConfig
from router.ops import connections
from router.ops.audit import record
from router.ops.error_text import signature
from router.ops.groups import FailureGroup, group_id
from router.ops.outbox import wake_targets
from router.ops.schema import gaps, outbox
from router.ops.times import utc
from router.relay.store.base import OPEN_STATUSES, SET_ASIDE_STATUSES

__all__ = ["HeldKey", "Released", "held_keys", "release", "release_group"]

# The rows of a key still to be delivered behind its head.
_WAITING = (*OPEN_STATUSES, *SET_ASIDE_STATUSES)


@dataclass(frozen=True)
class HeldKey:
    """One stream key that waits for an operator on one target, as its head says."""

    database: str
    target: str
    stream_key: str
    status: str
    """``held`` or ``parked``: the head's status."""
    seq: int
    message_id: str
    last_error: str | None
    since: str | None
    """When the head was last tried (and given up on), in UTC."""
    age_seconds: float | None
    behind: int
    """The rows of the key after the head, still to be delivered."""
    group: str
    """The failure group of the head's error (``router groups``, ``release --group``)."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self)


@dataclass(frozen=True)
class Released:
    """What one release did to one key in one database."""

    database: str
    target: str
    stream_key: str
    message_id: str
    """The head's."""
    dropped: bool
    """True: the head was abandoned (its gap recorded); False: it will be tried again."""
    rows: int
    """The rows put back to pending (the head among them, unless dropped)."""
    audit_id: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self)


async def held_keys(
    config: RouterConfig, target: str | None = None, database: str | None = None
) -> list[HeldKey]:
    """Every held and parked key (of ``target``, if given), oldest head first."""
    if target is not None:
        connections.check_targets(config, database, [target])
    found: list[HeldKey] = []
    for name in connections.database_names(config, database):
        async with connections.connect(config, name) as conn:
            for head in await _heads(conn, target):
                found.append(await _held_key(conn, name, head))
    found.sort(key=lambda k: (k.since or "", k.database, k.target, k.stream_key))
    return found


async def _heads(conn: AsyncConnection, target: str | None) -> list[Any]:
    """The head of each held or parked key: its first row held or parked."""
    o = outbox
    first = (
        sa.select(o.c.target, o.c.stream_key, sa.func.min(o.c.seq).label("seq"))
        .where(o.c.status.in_(SET_ASIDE_STATUSES), o.c.stream_key.is_not(None))
        .group_by(o.c.target, o.c.stream_key)
    )
    if target is not None:
        first = first.where(o.c.target == target)
    seqs = [int(row.seq) for row in await conn.execute(first)]
    if not seqs:
        return []
    return list(await conn.execute(sa.select(o).where(o.c.seq.in_(seqs)).order_by(o.c.seq)))


async def _held_key(conn: AsyncConnection, database: str, head: Any) -> HeldKey:
    since = utc(head.last_attempt_at)
    age = (connections.now() - since).total_seconds() if since is not None else None
    return HeldKey(
        database=database,
        target=head.target,
        stream_key=head.stream_key,
        status=head.status,
        seq=int(head.seq),
        message_id=str(head.message_id),
        last_error=head.last_error,
        since=connections.iso(since),
        age_seconds=None if age is None else round(max(0.0, age), 3),
        behind=await _behind(conn, head),
        group=group_id(database, head.target, signature(head.last_error)),
    )


async def _behind(conn: AsyncConnection, head: Any) -> int:
    o = outbox
    query = (
        sa.select(sa.func.count())
        .select_from(o)
        .where(
            o.c.target == head.target,
            o.c.stream_key == head.stream_key,
            o.c.seq > head.seq,
            o.c.status.in_(_WAITING),
        )
    )
    return int((await conn.execute(query)).scalar_one())


async def release(
    config: RouterConfig,
    target: str,
    stream_key: str,
    *,
    drop: bool = False,
    reason: str,
    actor: str,
    database: str | None = None,
) -> list[Released]:
    """Release ``stream_key`` on ``target`` in every database that holds it there (or
    ``database``): retry its head, or with ``drop`` abandon it; the rest of a parked key back
    to pending. One audit row per database released in. Empty when no database holds the key
    (nothing is written then)."""
    _check_reason(reason)
    connections.check_targets(config, database, [target])
    done: list[Released] = []
    for name in connections.database_names(config, database):
        if target not in config.brokers_of(name):
            continue
        async with connections.connect(config, name) as conn:
            released = await _release_key(conn, name, target, stream_key, drop=drop)
            if released is None:
                continue
            audit_id = await record(
                conn,
                actor=actor,
                action="release",
                target=target,
                detail=_detail(released, reason),
                row_count=released.rows,
            )
            await wake_targets(conn, [target])
        done.append(_with_audit(released, audit_id))
    return done


async def release_group(
    config: RouterConfig, group: FailureGroup, *, drop: bool = False, reason: str, actor: str
) -> list[Released]:
    """Release every held or parked key of the group's target whose head's error is one of
    the group's (``router.ops.groups``), in the group's database, in one transaction with one
    audit row for them all."""
    _check_reason(reason)
    done: list[Released] = []
    async with connections.connect(config, group.database) as conn:
        for head in await _heads(conn, group.target):
            if head.last_error not in group.errors:
                continue
            released = await _release_key(
                conn, group.database, group.target, head.stream_key, drop=drop
            )
            if released is not None:
                done.append(released)
        if not done:
            return []
        detail = {
            "database": group.database,
            "group": group.id,
            "drop": drop,
            "reason": reason,
            "keys": [r.stream_key for r in done],
            "message_ids": [r.message_id for r in done],
        }
        audit_id = await record(
            conn,
            actor=actor,
            action="release",
            target=group.target,
            detail=detail,
            row_count=sum(r.rows for r in done),
        )
        await wake_targets(conn, [group.target])
    return [_with_audit(r, audit_id) for r in done]


def _check_reason(reason: str) -> None:
    """A release is audited with why: an empty reason is the operator's mistake."""
    if not reason.strip():
        raise ConfigError("a release needs a reason (--reason), for the audit trail")


async def _release_key(
    conn: AsyncConnection, database: str, target: str, stream_key: str, *, drop: bool
) -> Released | None:
    """Release one key in ``conn``'s transaction (None: it is not held or parked here)."""
    o = outbox
    head_query = (
        sa.select(o)
        .where(
            o.c.target == target,
            o.c.stream_key == stream_key,
            o.c.status.in_(SET_ASIDE_STATUSES),
        )
        .order_by(o.c.seq)
        .limit(1)
    )
    head = (await conn.execute(head_query)).first()
    if head is None:
        return None
    now = connections.clock(conn)
    back = {"available_at": now, "locked_by": None, "locked_until": None, "lease_token": None}
    if drop:
        await conn.execute(sa.update(o).where(o.c.seq == head.seq).values(status="abandoned"))
        await conn.execute(
            sa.insert(gaps).values(
                target=target,
                stream_key=stream_key,
                seq=head.seq,
                message_id=head.message_id,
                abandoned_at=now,
            )
        )
        rows = 0
    else:
        retry = sa.update(o).where(o.c.seq == head.seq, o.c.status.in_(SET_ASIDE_STATUSES))
        await conn.execute(retry.values(status="pending", attempts=0, **back))
        rows = 1
    # The rest of a parked key, in its order behind the head (a held key's rows are pending).
    rest = sa.update(o).where(
        o.c.target == target,
        o.c.stream_key == stream_key,
        o.c.seq > head.seq,
        o.c.status == "parked",
    )
    rows += (await conn.execute(rest.values(status="pending", **back))).rowcount or 0
    return Released(database, target, stream_key, str(head.message_id), drop, rows)


def _detail(released: Released, reason: str) -> dict[str, Any]:
    """What the audit row says of one key's release."""
    return {
        "database": released.database,
        "stream_key": released.stream_key,
        "message_id": released.message_id,
        "drop": released.dropped,
        "reason": reason,
    }


def _with_audit(released: Released, audit_id: int) -> Released:
    return Released(**{**asdict(released), "audit_id": audit_id})
