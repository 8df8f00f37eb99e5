"""The statements ``stage()`` runs on PostgreSQL: lock the rows' stream keys, wake an idle
relay, insert. Four forms of one insert, by the rows and what the driver can run:

- one event's rows (or up to 16 rows on at most one stream key): a VALUES list behind a gate
  that takes the key's lock and wakes an idle relay (``_small_insert``); for a driver that
  prepares nothing, the gate and the INSERT as two statements of one simple query
  (``_simple_insert``);
- more rows: every column an array, unnested, after the locks (``INSERT_NAMED``);
- 64 rows or more through psycopg 3: the locks and the wake, then a binary ``COPY``.

Parameters are named (``:name``), as SQLAlchemy's ``text()`` and the DB-API drivers take them;
asyncpg gets them numbered (``numbered``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

from router._schema import OUTBOX
from router._wakeup import CHANNEL, WAKE_LOCK_NAMESPACE
from router.write.statements import Copy, Row, Statement

__all__ = [
    "INSERT_NAMED",
    "STREAM_LOCK_NAMESPACE",
    "STREAM_LOCK_SLOTS",
    "PostgresStatements",
    "numbered",
]

_COLUMNS = "message_id, target, destination, event_type, stream_key, envelope"

# Per-stream commit order on PostgreSQL: before any row gets its seq, the transaction takes
# a transaction-scoped advisory lock on each of its stream keys' slots (in slot order, so two
# stagers never wait on each other in a cycle). A second transaction staging on the same key
# waits until the first commits or rolls back, so per stream key, seq order is commit order,
# and a later row can never become visible while an earlier one is still in flight. The
# scalar subquery is an InitPlan: it runs before the first row reaches the INSERT, i.e.
# before any seq is drawn.
#
# A key's lock is its slot, ``hashtext(key) & (STREAM_LOCK_SLOTS - 1)``, the same in every
# statement (one key or 20,000), so every transaction on a key takes the same lock. A lock
# per key would take one entry of PostgreSQL's shared lock table per key, and the table holds
# max_locks_per_transaction x max_connections for the whole server (6,400 by default): about
# 6,000 keys in one transaction ended it with "out of shared memory", and any other session
# needing a lock meanwhile with it. With slots, a transaction holds at most 1,024 however
# many keys it stages, in one call or in a loop of calls; five such at once fit the default
# table. The price: two transactions on unrelated keys of one slot take turns, as if they
# shared a key: with N stagers in flight at once, each waits on an unrelated one with odds
# about (N - 1) / 1,024. 4,096 slots would make that a quarter, but two large transactions
# at once would fill the default table. The one-event path keeps its one statement and one
# lock; it adds an integer AND, tens of nanoseconds of a transaction's 600 us or so (4
# million of them took no longer than as many casts to bigint; 2,000 one-event stage()
# transactions, the two forms taking turns, differed by less than the machine's noise).
# The keys come distinct (``_stream_keys``); two of one slot take its lock twice in a row,
# which a transaction's advisory lock allows (the second is a lookup in the backend's own
# table), so no DISTINCT (a fifth of the statement's time over 1,000 keys).
STREAM_LOCK_SLOTS = 1024
"""Advisory locks per-stream order uses on PostgreSQL: a key locks ``hashtext(key) & 1023``."""
_SLOT = f"hashtext({{key}}) & {STREAM_LOCK_SLOTS - 1}"
_STREAM_LOCKS = f"""(
    SELECT count(pg_advisory_xact_lock({{namespace}}, h))
    FROM (SELECT {_SLOT.format(key="k")} AS h FROM unnest({{keys}}) AS k ORDER BY h) AS keys
) >= 0"""
STREAM_LOCK_NAMESPACE = 1869903202
"""First key of the stream slots' advisory locks (the second is the slot)."""

# Waking the relay on PostgreSQL, with nothing on the commit path while a relay is busy (see
# "Waking the relay" in docs/architecture.md). A NOTIFY makes its transaction take an
# instance-wide lock at COMMIT, held until the commit record is flushed, so notifying
# transactions commit one at a time: with 4+ writers, 0.4x a hand-written outbox. So a
# transaction notifies only when a relay needs it: a relay that is idle and listening holds
# its target's wake lock exclusively (a session advisory lock); a stager tries that lock
# shared for each of its targets, and notifies only when a try fails. A busy relay holds no
# wake lock: the try succeeds, nothing is queued, and the relay's next claim finds the rows.
# The shared lock lasts until the stager's transaction ends, so a relay going idle cannot
# take its wake lock (and look once more) before the rows it did not hear of are committed.
_WAKE_TRY = f"pg_try_advisory_xact_lock_shared({WAKE_LOCK_NAMESPACE}, hashtext({{target}}))"
_WAKE_ANY = (
    f"(SELECT bool_and({_WAKE_TRY.format(target='w')}) "
    "FROM unnest(string_to_array({notify}, ',')) AS w)"
)


def _wake(notify: str, gate: str) -> str:
    """Notify ``notify`` (the targets) unless ``gate`` (their wake locks, tried shared) held."""
    return f"CASE WHEN {gate} THEN NULL ELSE pg_notify('{CHANNEL}', {notify}) END"


def _wake_many(notify: str) -> str:
    """``_wake`` for the targets listed in ``notify`` (``a,b,c``), one try each."""
    typed = f"CAST({notify} AS text)"  # a parameter's type, which asyncpg cannot infer here
    return _wake(typed, _WAKE_ANY.format(notify=typed))


# Many rows at once: every column an array, unnested, after the stream keys' locks. Written
# with named parameters, as SQLAlchemy's text() and the DB-API drivers take them (``:name`` or
# ``%(name)s``, ``Statement``); asyncpg gets them numbered (``_numbered``).
_INSERT_NAMED_TEMPLATE = f"""
WITH inserted AS (
    INSERT INTO {OUTBOX} ({_COLUMNS})
    SELECT * FROM unnest(
        CAST(:ids AS uuid[]), CAST(:targets AS text[]), CAST(:destinations AS text[]),
        CAST(:types AS text[]), CAST(:streams AS text[]), CAST(:envelopes AS json[]))
    WHERE {_STREAM_LOCKS.format(namespace=STREAM_LOCK_NAMESPACE, keys="CAST(:locks AS text[])")}
    RETURNING 1
)
SELECT {{wake}}
"""

INSERT_NAMED = _INSERT_NAMED_TEMPLATE.format(wake=_wake_many(":notify"))
_INSERT_NAMED_QUIET = _INSERT_NAMED_TEMPLATE.format(wake="1")

# A few rows on at most one stream key (one event's rows, say): a plain VALUES list, with no
# unnest, whose planning and running over six arrays cost more than the insert itself at
# this size, and no CTE. What the rows of one event share (id, type, key, envelope) is one
# parameter each, sent once however many targets. The lock and the NOTIFY are a gate: an
# uncorrelated scalar subquery in WHERE, which PostgreSQL runs once, as an InitPlan, before
# the first row reaches the INSERT (a One-Time Filter), i.e. before any seq is drawn, as
# above; volatile, their calls are never planned away.
_SMALL_ROWS = 16
_LOCK = f"pg_advisory_xact_lock({STREAM_LOCK_NAMESPACE}, {_SLOT.format(key=':k')})"
_ROW = "(CAST(:m{j} AS uuid), :t{i}, :d{i}, :e{j}, :s{j}, CAST(:v{j} AS json))"
# The parameters of one event's own values in the small form (``_event_names(0)``) and its
# stream key's lock; the others depend only on the event's targets and destinations.
_ONE_EVENT_OWN = frozenset({"k", "m0", "e0", "s0", "v0"})


def _small_insert(targets: tuple[int, ...], locked: bool, wakes: int) -> str:
    """The statement for events with ``targets[j]`` rows each, after the lock of their one
    stream key if any and the wake of their ``wakes`` targets (none: no NOTIFY)."""
    calls = _gate_calls(locked, wakes)
    insert = f"INSERT INTO {OUTBOX} ({_COLUMNS}) SELECT * FROM (VALUES {_rows_of(targets)}) AS r"
    if not calls:
        return insert
    return f"{insert} WHERE (SELECT true FROM (SELECT {', '.join(calls)}) AS g)"


def _gate_calls(locked: bool, wakes: int) -> list[str]:
    """What runs before the rows: the stream key's lock, then the wake of ``wakes`` targets
    (``:w0``...; their tries in one CASE, no subquery to plan)."""
    calls = [_LOCK] if locked else []
    if wakes:
        tries = " AND ".join(_WAKE_TRY.format(target=f":w{n}") for n in range(wakes))
        calls.append(_wake(":notify", tries))
    return calls


def _rows_of(targets: tuple[int, ...]) -> str:
    """The VALUES rows of events with ``targets[j]`` rows each (``_ROW``)."""
    rows: list[str] = []
    i = 0
    for j, count in enumerate(targets):
        rows.extend(_ROW.format(i=n, j=j) for n in range(i, i + count))
        i += count
    return ", ".join(rows)


# The same rows for a driver that binds on the client and sends a simple query, where nothing
# is ever prepared (psycopg2; psycopg 3 with preparing off, as Django's connection has it by
# default): every statement is parsed and planned on each call, and there the gate's subquery
# costs more to plan than a second statement costs to run (30-40 us of a 700 us transaction).
# So two statements in one query: the lock and the NOTIFY, then a plain INSERT ... VALUES. The
# lock is held before the INSERT, the next statement, draws its first seq.
def _simple_insert(targets: tuple[int, ...], locked: bool, wakes: int) -> str:
    """``_small_insert``'s rows as two statements in one simple query."""
    calls = _gate_calls(locked, wakes)
    insert = f"INSERT INTO {OUTBOX} ({_COLUMNS}) VALUES {_rows_of(targets)}"
    return f"SELECT {', '.join(calls)}; {insert}" if calls else insert


# Many rows through a driver that can COPY (psycopg 3): one statement takes the stream keys'
# locks (as INSERT_NAMED does) and queues the wake, then COPY writes the rows, the fastest way
# in. The locks are held before COPY draws the first seq; the NOTIFY, like any, is delivered
# only at COMMIT, so queued before the rows it is the same as after them. COPY pays a round
# trip of its own, so a few dozen rows go faster by unnest.
_COPY_ROWS = 64
_COPY_LOCKS = _STREAM_LOCKS.format(namespace=STREAM_LOCK_NAMESPACE, keys="CAST(:locks AS text[])")
COPY_ROWS = f"COPY {OUTBOX} ({_COLUMNS}) FROM STDIN (FORMAT BINARY)"
# Binary COPY carries no types: the server reads each field with its column's binary input.
# A uuid's is its 16 bytes, sent as bytea; json's is its text. Both are dumped in C, where
# uuid.UUID objects would cost a parse of every id in Python (binary was 9% faster than text
# COPY for 1,000 rows by hand).
_COPY_TYPES = ("bytea", "text", "text", "text", "text", "text")


class PostgresStatements:
    """The statements of ``stage()`` calls on PostgreSQL, with the texts of the shapes an
    application uses kept (a few per event class)."""

    def __init__(self) -> None:
        self._small_inserts: dict[tuple[tuple[int, ...], bool, int, bool], str] = {}
        self._one_events: dict[
            tuple[tuple[tuple[str, str], ...], bool, bool, bool], tuple[str, dict[str, Any]]
        ] = {}

    def statements(
        self, rows: Sequence[Row], *, copy: bool, simple: bool, notify: bool
    ) -> list[Statement | Copy]:
        """The statements that insert ``rows`` in order; ``copy``, ``simple`` and ``notify``
        as ``Stager.statements`` takes them."""
        one = self._one_event(rows, simple, notify) if len(rows) <= _SMALL_ROWS else None
        if one is not None:
            return [one]
        keys = _stream_keys(rows)
        if len(rows) <= _SMALL_ROWS and len(keys) <= 1:
            return [self._small(rows, keys, simple, notify)]
        targets_listed = _notify_payload(rows)
        if copy and len(rows) >= _COPY_ROWS:
            calls = [_wake_many(":notify")] if notify else []
            if keys:
                calls.append(_COPY_LOCKS)
            before: list[Statement | Copy] = []
            if calls:
                named = {"notify": targets_listed, "locks": keys}
                before.append(Statement(f"SELECT {', '.join(calls)}", named))
            return [*before, Copy(COPY_ROWS, _COPY_TYPES, _copy_rows(rows))]
        ids, targets, destinations, types, streams, envelopes = _columns(rows)
        params = {
            "ids": ids,
            "targets": targets,
            "destinations": destinations,
            "types": types,
            "streams": streams,
            "envelopes": envelopes,
            "notify": targets_listed,
            "locks": keys,
        }
        return [Statement(INSERT_NAMED if notify else _INSERT_NAMED_QUIET, params)]

    def _one_event(self, rows: Sequence[Row], simple: bool, notify: bool) -> Statement | None:
        """``_small``'s statement for the rows of one event (None for any other rows),
        from what it was for the first event with these targets and destinations: the text
        and every parameter but the event's id, type, stream key and envelope are the same."""
        if not rows:
            return None
        first = rows[0]
        for r in rows:
            if r.message_id != first.message_id or r.stream_key != first.stream_key:
                return None
        key = first.stream_key
        locked = key is not None
        shape = (tuple([(r.target, r.destination) for r in rows]), locked, simple, notify)
        cached = self._one_events.get(shape)
        if cached is None:
            statement = self._small(rows, [] if key is None else [key], simple, notify)
            assert isinstance(statement.params, dict)  # PostgreSQL's are named
            shared = {k: v for k, v in statement.params.items() if k not in _ONE_EVENT_OWN}
            if len(self._one_events) < 256:  # the targets of an application's events are few
                self._one_events[shape] = (statement.sql, shared)
            return statement
        sql, shared = cached
        params = shared.copy()
        if locked:
            params["k"] = key
        params["m0"], params["e0"], params["s0"], params["v0"] = (
            first.message_id,
            first.event_type,
            key,
            first.envelope,
        )
        return Statement(sql, params, simple)

    def _small(
        self, rows: Sequence[Row], keys: Sequence[str], simple: bool, notify: bool
    ) -> Statement:
        params: dict[str, Any] = {}
        wakes = 0
        if notify:
            listed = sorted({r.target for r in rows})
            params["notify"] = ",".join(listed)
            params.update(zip(_wake_names(len(listed)), listed, strict=True))
            wakes = len(listed)
        if keys:
            params["k"] = keys[0]
        targets: list[int] = []
        for i, r in enumerate(rows):
            names = _row_names(i)
            params[names[0]], params[names[1]] = r.target, r.destination
            # An event's rows are together, in order (build_rows): a new id starts the next.
            if i == 0 or r.message_id != rows[i - 1].message_id:
                m, e, s, v = _event_names(len(targets))
                params[m], params[e], params[s], params[v] = (
                    r.message_id,
                    r.event_type,
                    r.stream_key,
                    r.envelope,
                )
                targets.append(0)
            targets[-1] += 1
        shape = (tuple(targets), bool(keys), wakes, simple)
        sql = self._small_inserts.get(shape)
        if sql is None:
            sql = (_simple_insert if simple else _small_insert)(*shape[:3])
            if len(self._small_inserts) < 256:  # the shapes an application uses are few
                self._small_inserts[shape] = sql
        return Statement(sql, params, simple)


def _columns(
    rows: Sequence[Row],
) -> tuple[list[str], list[str], list[str], list[str], list[str | None], list[str]]:
    return (
        [r.message_id for r in rows],
        [r.target for r in rows],
        [r.destination for r in rows],
        [r.event_type for r in rows],
        [r.stream_key for r in rows],
        [r.envelope for r in rows],
    )


@functools.cache
def _row_names(i: int) -> tuple[str, str]:
    """The parameters of row ``i``'s target and destination in the small form."""
    return f"t{i}", f"d{i}"


_NAMED = re.compile(r"(?<![:\w]):([a-z]\w*)")


def numbered(sql: str) -> tuple[str, tuple[str, ...]]:
    """``sql``'s ``:name`` parameters as asyncpg's ``$1, $2...``, and the names in that order
    (a name used twice keeps its one number). Its one caller keeps the answer per statement
    text (``router.write.async_drivers``): the texts are few."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    return _NAMED.sub(number, sql), tuple(names)


@functools.cache
def _wake_names(count: int) -> tuple[str, ...]:
    """The parameters of the small form's ``count`` targets to wake, in their tries."""
    return tuple(f"w{n}" for n in range(count))


@functools.cache
def _event_names(j: int) -> tuple[str, str, str, str]:
    """The parameters of event ``j``'s id, type, stream key and envelope in the small form."""
    return f"m{j}", f"e{j}", f"s{j}", f"v{j}"


def _copy_rows(rows: Sequence[Row]) -> list[tuple[bytes | str | None, ...]]:
    """The rows as ``Copy`` sends them: an id as its 16 bytes, a uuid's binary form."""
    return [
        (
            bytes.fromhex(r.message_id.replace("-", "")),
            r.target,
            r.destination,
            r.event_type,
            r.stream_key,
            r.envelope,
        )
        for r in rows
    ]


def _stream_keys(rows: Sequence[Row]) -> list[str]:
    return sorted({r.stream_key for r in rows if r.stream_key is not None})


def _notify_payload(rows: Sequence[Row]) -> str:
    return ",".join(sorted({r.target for r in rows}))
