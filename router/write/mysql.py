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


# The envelope goes in the statement's text as a hex literal, not as a parameter: PyMySQL (and
# aiomysql) escape a parameter in Python, a mapping lookup per character, which for a 381-byte
# envelope cost more instructions than the rest of the statement's execution (callgrind, one
# row through SQLAlchemy: 413k instructions a call with it as a parameter, 279k as a literal;
# ``bench.stage_cpu``). bytes.hex() is C, and a hex literal holds no quote, backslash or
# ``%`` whatever the payload or the server's sql_mode (NO_BACKSLASH_ESCAPES included), so
# nothing in it needs escaping. The server decodes it as it parses; CONVERT makes it text.
_ENVELOPE_HEAD = "CONVERT(X'"
_ENVELOPE_TAIL = "' USING utf8mb4)"


def _literal(envelope: str) -> str:
    """``envelope`` as a SQL literal of MySQL's: its UTF-8 bytes in hex, as text."""
    return _ENVELOPE_HEAD + envelope.encode().hex() + _ENVELOPE_TAIL


@dataclass(frozen=True, slots=True)
class _Texts:
    """The statement texts of rows with their six columns, or seven with ``xid``: the
    envelope's literal goes between a text's head and its tail."""

    insert: str
    row_head: str
    row_tail: str
    one_head: str
    one_tail: str
    locked_many: str
    numbered_head: str
    numbered_tail: str
    xid: bool

    @classmethod
    def of(cls, *, xid: bool) -> _Texts:
        """The texts with the ``xid`` column, or without."""
        columns = "message_id, target, destination, event_type, stream_key, envelope"
        picked = "r.m, r.t, r.d, r.e, r.s, r.v"
        marks = "%s, %s, %s, %s, %s, "
        after = ", %s" if xid else ""
        if xid:
            columns, picked = columns + ", xid", picked + ", r.x"
        return cls(
            insert=f"INSERT INTO {OUTBOX} ({columns}) VALUES ",
            row_head=f"({marks}",
            row_tail=f"{after})",
            one_head=f"INSERT INTO {OUTBOX} ({columns}) SELECT {marks}",
            one_tail=f"{after} FROM {STREAMS} WHERE stream_key = %s FOR UPDATE",
            # Several rows under one lock: a derived table numbered in the caller's order, and
            # ORDER BY (which INSERT ... SELECT follows when it gives rows their seq) to keep
            # that order.
            locked_many=f"INSERT INTO {OUTBOX} ({columns}) SELECT {picked} FROM {STREAMS} AS l "
            "JOIN ({rows}) AS r WHERE l.stream_key = %s ORDER BY r.n FOR UPDATE",
            numbered_head="SELECT {n} AS n, %s AS m, %s AS t, %s AS d, %s AS e, %s AS s, ",
            numbered_tail=" AS v" + (", %s AS x" if xid else ""),
            xid=xid,
        )

    def values(self, rows: Sequence[Row]) -> str:
        """The rows' VALUES list."""
        head, tail = self.row_head, self.row_tail
        return ", ".join([head + _literal(r.envelope) + tail for r in rows])


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
        statements.append(Statement(texts.insert + texts.values(chunk), _params(chunk, texts)))
    return statements


def _locked(rows: Sequence[Row], slot: str, texts: _Texts) -> Statement:
    """One statement that locks ``slot`` and inserts ``rows`` after it."""
    repair = Statement(_LOCK_ONE_SLOT, (slot,))
    params = (*_params(rows, texts), slot)
    if len(rows) == 1:
        sql = texts.one_head + _literal(rows[0].envelope) + texts.one_tail
        return Statement(sql, params, repair=repair)
    numbered = " UNION ALL ".join(
        texts.numbered_head.format(n=n) + _literal(r.envelope) + texts.numbered_tail
        for n, r in enumerate(rows)
    )
    return Statement(texts.locked_many.format(rows=numbered), params, repair=repair)


def _params(rows: Sequence[Row], texts: _Texts) -> tuple[str | int | None, ...]:
    """The rows' parameters in order: each row's columns but its envelope (a literal)."""
    if texts.xid:
        return tuple(
            value
            for r in rows
            for value in (r.message_id, r.target, r.destination, r.event_type, r.stream_key, r.xid)
        )
    return tuple(
        value
        for r in rows
        for value in (r.message_id, r.target, r.destination, r.event_type, r.stream_key)
    )


def _chunks(rows: Sequence[Row]) -> list[Sequence[Row]]:
    """The rows in order, cut where a statement would pass ``_MAX_BYTES``."""
    chunks: list[Sequence[Row]] = []
    start, size = 0, 0
    for i, row in enumerate(rows):
        # The envelope's hex is two characters a byte, up to four bytes a character.
        length = 8 * len(row.envelope) + len(row.destination) + len(row.event_type) + 200
        if i > start and size + length > _MAX_BYTES:
            chunks.append(rows[start:i])
            start, size = i, 0
        size += length
    chunks.append(rows[start:])
    return chunks
