"""The statements ``stage()`` runs on MySQL and MariaDB: lock the rows' stream keys, insert.

Per-stream commit order needs a lock that the caller's COMMIT or ROLLBACK releases. MySQL and
MariaDB have no transaction-scoped advisory lock: ``GET_LOCK()`` belongs to the session, so it
outlives COMMIT and ROLLBACK, ``stage()`` (which never sees the caller's commit) could not
release it, and a pooled session would hold it for the next user. So a transaction locks a
row of ``router_streams`` instead, which InnoDB holds until the transaction ends: a second
transaction staging on the same key waits for the first's COMMIT or ROLLBACK, and per stream
key ``seq`` order is commit order, as with PostgreSQL's advisory locks.

Since migration 0015 the table holds one row per lock slot, ``'0'`` to ``'1023'``: a key
locks slot ``crc32(key) & 1023``, as on PostgreSQL (``hashtext(key) & 1023``), so the table
no longer grows by a row per key ever staged, and two keys that share a slot only take turns.

- One stream key for the whole call (the common case, one event): one statement,
  ``INSERT ... SELECT ... FROM router_streams WHERE stream_key = <slot> FOR UPDATE``. The
  locking read of the slot's row comes before the rows are written, so before they get their
  ``seq``. Upserting the key first, as before 0015, cost a second round trip, and a row per new
  key: ``bench.write_concurrency`` measured stage() at 0.54-0.72x a hand-written insert on
  MariaDB with it. Should the slot's row be missing (deleted by hand), the statement inserts
  nothing: its ``repair`` puts the row back and the statement runs again (``Statement``).
- Several stream keys: an upsert of their slots' rows, in sorted order (two such transactions
  lock in the same order and cannot deadlock; a missing row is inserted, and locked), then the
  rows in one ``INSERT ... VALUES``.
- No stream key: the ``INSERT ... VALUES`` alone.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from envelopes import StagingError
from router._schema import OUTBOX, STREAMS
from router.write.statements import Row, Statement

__all__ = ["MYSQL_MAX_STREAM_KEY", "STREAM_SLOTS", "mysql_statements", "slot_of"]

STREAM_SLOTS = 1024
"""How many rows of ``router_streams`` stream keys lock (the same count as PostgreSQL's)."""

MYSQL_MAX_STREAM_KEY = 512
"""The longest stream key MySQL keeps (``router_outbox`` indexes it)."""


@dataclass(frozen=True, slots=True)
class _Texts:
    """The statement texts of rows with their six columns, or seven with ``xid``."""

    insert: str
    row: str
    locked_one: str
    locked_many: str
    numbered: str
    xid: bool

    @classmethod
    def of(cls, *, xid: bool) -> _Texts:
        """The texts with the ``xid`` column, or without."""
        columns = "message_id, target, destination, event_type, stream_key, envelope"
        numbered = "SELECT {n} AS n, %s AS m, %s AS t, %s AS d, %s AS e, %s AS s, %s AS v"
        picked = "r.m, r.t, r.d, r.e, r.s, r.v"
        if xid:
            columns, numbered, picked = columns + ", xid", numbered + ", %s AS x", picked + ", r.x"
        marks = ", ".join(["%s"] * (7 if xid else 6))
        return cls(
            insert=f"INSERT INTO {OUTBOX} ({columns}) VALUES {{values}}",
            row=f"({marks})",
            locked_one=f"INSERT INTO {OUTBOX} ({columns}) SELECT {marks} FROM {STREAMS} "
            "WHERE stream_key = %s FOR UPDATE",
            # Several rows under one lock: a derived table numbered in the caller's order, and
            # ORDER BY (which INSERT ... SELECT follows when it gives rows their seq) to keep
            # that order.
            locked_many=f"INSERT INTO {OUTBOX} ({columns}) SELECT {picked} FROM {STREAMS} AS l "
            "JOIN ({rows}) AS r WHERE l.stream_key = %s ORDER BY r.n FOR UPDATE",
            numbered=numbered,
            xid=xid,
        )


# The rows of atomic targets carry their transaction's token (``Row.xid``); a call without
# one keeps the six columns it always had.
_PLAIN, _WITH_XID = _Texts.of(xid=False), _Texts.of(xid=True)
_LOCK_SLOTS = (
    f"INSERT INTO {STREAMS} (stream_key) VALUES {{values}} "
    "ON DUPLICATE KEY UPDATE stream_key = stream_key"
)
_LOCK_ONE_SLOT = _LOCK_SLOTS.format(values="(%s)")
# One statement per stage() call, split only past a few MB of envelopes: a statement must fit
# the server's max_allowed_packet (4 MB on older servers, 16 MB on MariaDB, 64 MB on MySQL 8).
_MAX_BYTES = 4 << 20


def slot_of(key: str) -> str:
    """The ``router_streams`` row that ``key`` locks: its slot's number, as text."""
    return str(zlib.crc32(key.encode("utf-8", "surrogatepass")) & (STREAM_SLOTS - 1))


def mysql_statements(rows: Sequence[Row]) -> list[Statement]:
    """Lock the rows' stream keys and insert the rows, in order; ``StagingError`` before any
    statement runs if a stream key is longer than MySQL keeps."""
    only = rows[0].stream_key if len(rows) == 1 else None
    if only is not None and len(only) <= MYSQL_MAX_STREAM_KEY:
        # The common call, one event for one target on a stream: its statement straight
        # away, without the general case's sets and loops (one row is one chunk).
        texts = _PLAIN if rows[0].xid is None else _WITH_XID
        return [_locked(rows, slot_of(only), texts)]
    keys = {r.stream_key for r in rows if r.stream_key is not None}
    for key in keys:
        if len(key) > MYSQL_MAX_STREAM_KEY:
            raise StagingError(
                f"stream key {key[:40]!r}... is {len(key):,} characters; "
                f"a MySQL outbox keeps stream keys of at most {MYSQL_MAX_STREAM_KEY}"
            )
    chunks = _chunks(rows)
    slots = sorted({slot_of(key) for key in keys})
    texts = _WITH_XID if any(r.xid is not None for r in rows) else _PLAIN
    if len(slots) == 1 and len(chunks) == 1:
        return [_locked(rows, slots[0], texts)]
    statements = []
    if slots:
        values = ", ".join(["(%s)"] * len(slots))
        statements.append(Statement(_LOCK_SLOTS.format(values=values), tuple(slots)))
    for chunk in chunks:
        values = ", ".join([texts.row] * len(chunk))
        statements.append(Statement(texts.insert.format(values=values), _params(chunk, texts)))
    return statements


def _locked(rows: Sequence[Row], slot: str, texts: _Texts) -> Statement:
    """One statement that locks ``slot`` and inserts ``rows`` after it."""
    repair = Statement(_LOCK_ONE_SLOT, (slot,))
    params = (*_params(rows, texts), slot)
    if len(rows) == 1:
        return Statement(texts.locked_one, params, repair=repair)
    numbered = " UNION ALL ".join(texts.numbered.format(n=n) for n in range(len(rows)))
    return Statement(texts.locked_many.format(rows=numbered), params, repair=repair)


def _params(rows: Sequence[Row], texts: _Texts) -> tuple[str | int | None, ...]:
    width = 7 if texts.xid else 6
    return tuple(
        value
        for r in rows
        for value in (
            r.message_id,
            r.target,
            r.destination,
            r.event_type,
            r.stream_key,
            r.envelope,
            r.xid,
        )[:width]
    )


def _chunks(rows: Sequence[Row]) -> list[Sequence[Row]]:
    """The rows in order, cut where a statement would pass ``_MAX_BYTES``."""
    chunks: list[Sequence[Row]] = []
    start, size = 0, 0
    for i, row in enumerate(rows):
        length = len(row.envelope) + len(row.destination) + len(row.event_type) + 200
        if i > start and size + length > _MAX_BYTES:
            chunks.append(rows[start:i])
            start, size = i, 0
        size += length
    chunks.append(rows[start:])
    return chunks
