"""The console's message browser: the outbox's rows, newest first, filtered and keyset-paged
by ``seq``; and one message as each of its targets receives it.

The queries are SQLAlchemy Core and run on PostgreSQL, SQLite and MySQL/MariaDB alike. A
``seq`` means something only in its own database, so browsing several databases at once
pages with one cursor per database (``main:120,other:88``) and merges their rows by
``created_at``, each database's rows kept in their own order.
"""

from __future__ import annotations

import heapq
import itertools
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from brokers import BrokerSettings
from envelopes import DowncastError
from router.config import RouterConfig
from router.ops import connections
from router.ops.outbox import OPEN, trace
from router.ops.preview import OnWire
from router.ops.schema import gaps, outbox
from router.write.pinning import Received

__all__ = ["MAX_LIMIT", "MessageRow", "QueryError", "message", "messages"]

MAX_LIMIT = 200
ERROR_CHARS = 300
MIN_PREFIX = 8
_ID_TEXT = re.compile(r"[0-9a-f-]+")


class QueryError(ValueError):
    """A filter or cursor the browser cannot use (the console answers 400)."""


@dataclass(frozen=True)
class MessageRow:
    """One outbox row, without its envelope."""

    seq: int
    database: str
    message_id: str
    target: str
    event_type: str
    stream_key: str | None
    status: str
    attempts: int
    created_at: str | None
    published_at: str | None
    last_error: str | None
    """At most ``ERROR_CHARS`` characters of it."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self)


async def messages(
    config: RouterConfig,
    *,
    database: str | None = None,
    q: str | None = None,
    event_type: str | None = None,
    stream_key: str | None = None,
    status: str | None = None,
    error: str | None = None,
    target: str | None = None,
    limit: int = 50,
    before: int | str | None = None,
) -> tuple[list[MessageRow], int | str | None]:
    """One page of rows, newest first, and the ``before`` of the next page (None: no more).

    ``q`` is a message id, or its first ``MIN_PREFIX`` characters or more; ``error`` a piece
    of the last error in any case; the other filters are exact. ``before`` is a ``seq`` when
    one database is browsed, else the cursor a page answered (``main:120,other:88``). Raises
    QueryError for a ``q`` or ``before`` that cannot be used, DatabaseError for an unknown
    database or one that does not answer.
    """
    names = connections.database_names(config, database)
    limit = max(1, min(limit, MAX_LIMIT))
    where = _conditions(q, event_type, stream_key, status, error, target)
    cursors = _cursors(before, names)
    pages: dict[str, list[MessageRow]] = {}
    for name in names:
        if name in cursors:
            async with connections.connect(config, name) as conn:
                pages[name] = await _page(conn, name, where, cursors[name], limit + 1)
    merged = heapq.merge(*pages.values(), key=lambda r: (r.created_at or "", r.seq), reverse=True)
    rows = list(itertools.islice(merged, limit))
    after = _next_cursors(pages, rows)
    if len(names) == 1:
        return rows, after.get(names[0])
    return rows, ",".join(f"{name}:{seq}" for name, seq in after.items()) or None


def _conditions(
    q: str | None,
    event_type: str | None,
    stream_key: str | None,
    status: str | None,
    error: str | None,
    target: str | None,
) -> list[sa.ColumnElement[bool]]:
    o = outbox
    found: list[sa.ColumnElement[bool]] = []
    if q:
        found.append(_message_id_is(q))
    for column, value in (
        (o.c.event_type, event_type),
        (o.c.stream_key, stream_key),
        (o.c.status, status),
        (o.c.target, target),
    ):
        if value:
            found.append(column == value)
    if error:
        found.append(sa.func.lower(o.c.last_error).contains(error.lower(), autoescape=True))
    return found


def _message_id_is(q: str) -> sa.ColumnElement[bool]:
    text = q.strip().lower()
    try:
        return outbox.c.message_id == str(uuid.UUID(text))
    except ValueError:
        pass
    if len(text) >= MIN_PREFIX and _ID_TEXT.fullmatch(text):
        # Ids are uuid on PostgreSQL: compared as their text, which is how they are shown.
        return sa.cast(outbox.c.message_id, sa.String).startswith(text, autoescape=True)
    raise QueryError(f"q: a message id, or its first {MIN_PREFIX} characters or more")


def _cursors(before: int | str | None, names: Sequence[str]) -> dict[str, int | None]:
    """Where each database's page starts (None: at its newest row); a database that is not
    in a several-database cursor has no rows left."""
    if before is None or before == "":
        return dict.fromkeys(names)
    if isinstance(before, int) or before.strip().isdigit():
        if len(names) > 1:
            raise QueryError(
                "before: several databases are browsed; pass the next_before a page answered"
                " (database:seq,...), or name one database"
            )
        return {names[0]: int(before)}
    cursors: dict[str, int | None] = {}
    for part in before.split(","):
        name, _, seq = part.strip().rpartition(":")
        if name not in names or not seq.isdigit():
            raise QueryError(f"before: {part.strip()!r} is not database:seq of {list(names)}")
        cursors[name] = int(seq)
    return cursors


async def _page(
    conn: AsyncConnection,
    database: str,
    where: Sequence[sa.ColumnElement[bool]],
    before: int | None,
    size: int,
) -> list[MessageRow]:
    o = outbox
    query = (
        sa.select(
            o.c.seq,
            o.c.message_id,
            o.c.target,
            o.c.event_type,
            o.c.stream_key,
            o.c.status,
            o.c.attempts,
            o.c.created_at,
            o.c.published_at,
            # One character more than is shown, to know it was cut; a long text never loads.
            sa.func.substr(o.c.last_error, 1, ERROR_CHARS + 1).label("last_error"),
        )
        .where(*where)
        .order_by(o.c.seq.desc())
        .limit(size)
    )
    if before is not None:
        query = query.where(o.c.seq < before)
    return [_row(database, r) for r in await conn.execute(query)]


def _row(database: str, row: Any) -> MessageRow:
    error = row.last_error
    if error is not None and len(error) > ERROR_CHARS:
        error = error[: ERROR_CHARS - 1] + "…"
    return MessageRow(
        seq=int(row.seq),
        database=database,
        message_id=str(row.message_id),
        target=row.target,
        event_type=row.event_type,
        stream_key=row.stream_key,
        status=row.status,
        attempts=int(row.attempts),
        created_at=connections.iso(row.created_at),
        published_at=connections.iso(row.published_at),
        last_error=error,
    )


def _next_cursors(pages: Mapping[str, list[MessageRow]], shown: list[MessageRow]) -> dict[str, int]:
    """Each database's next ``before``, for those that have rows left. The merge keeps each
    database's order, so what was shown of a database is the start of its page."""
    after: dict[str, int] = {}
    for name, page in pages.items():
        used = sum(1 for row in shown if row.database == name)
        if used < len(page):
            after[name] = page[used - 1].seq if used else page[0].seq + 1
    return after


# --- one message ------------------------------------------------------------------------------


async def message(config: RouterConfig, message_id: str) -> list[dict[str, Any]]:
    """Every target's row of one message (``router.ops.outbox.trace``), each with ``message``: the
    message as that target receives it, rendered as its processor renders it (a row still to
    be sent after a gap in its stream names the gap, as it will). Empty when no row has the
    id."""
    try:
        message_id = str(uuid.UUID(message_id.strip()))
    except ValueError:
        return []
    rows = await trace(config, message_id)
    stored = await _stored(config, message_id) if rows else {}
    found = []
    for row in rows:
        seq, envelope, skipped = stored.get((row.database, row.target), (None, None, ()))
        received = None
        if envelope is not None:
            settings = config.brokers.get(row.target)
            received = _received(settings, row.destination, seq, envelope, skipped)
        found.append({**row.as_dict(), "seq": seq, "message": received})
    return found


Stored = tuple[int, str, tuple[str, ...]]
"""A row's seq, stored envelope, and the gap before it in its stream (message ids)."""


async def _stored(config: RouterConfig, message_id: str) -> dict[tuple[str, str], Stored]:
    """(database, target) -> what one message's row there holds."""
    o = outbox
    found: dict[tuple[str, str], Stored] = {}
    for name in config.databases:
        async with connections.connect(config, name) as conn:
            query = sa.select(o.c.seq, o.c.target, o.c.envelope, o.c.stream_key, o.c.status)
            for r in await conn.execute(query.where(o.c.message_id == message_id)):
                envelope = r.envelope if isinstance(r.envelope, str) else json.dumps(r.envelope)
                skipped: tuple[str, ...] = ()
                if r.stream_key is not None and r.status in OPEN:  # not sent yet: it will
                    skipped = await _gap_before(conn, r.target, r.stream_key, int(r.seq))
                found[(name, r.target)] = (int(r.seq), envelope, skipped)
    return found


async def _gap_before(conn: AsyncConnection, target: str, key: str, seq: int) -> tuple[str, ...]:
    """The message ids of the gaps before ``seq`` in its stream, oldest first, as the claim
    gives them (router_gaps' primary key)."""
    g = gaps
    query = (
        sa.select(g.c.message_id)
        .where(g.c.target == target, g.c.stream_key == key, g.c.seq < seq)
        .order_by(g.c.seq)
    )
    return tuple(str(mid) for mid in (await conn.execute(query)).scalars())


def _received(
    settings: BrokerSettings | None,
    destination: str,
    seq: int | None,
    stored: str,
    skipped: tuple[str, ...] = (),
) -> dict[str, Any]:
    """What the processor would publish (``Received``, which it publishes through), with the
    row's ``seq`` as the sequence and ``skipped`` as the gap before it, and the details the
    broker carries as ``router preview`` shows them (``OnWire``)."""
    if settings is None:
        return {"destination": destination, "error": "the target is no longer configured"}
    try:
        wire = Received(settings)(stored, sequence=seq, skipped=skipped)
    except DowncastError as exc:  # the row fails with this same error
        return {"destination": destination, "error": f"cannot downcast: {exc}"}
    except Exception as exc:  # an envelope that cannot be rendered: the row would fail too
        return {"destination": destination, "error": f"{type(exc).__name__}: {exc}"}
    return OnWire.of(settings, destination, wire).as_dict()
