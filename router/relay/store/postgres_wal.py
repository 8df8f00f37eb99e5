"""Wake-ups from PostgreSQL's own log: logical decoding of the rows inserted into the outbox.

::

    writer: INSERT router_outbox ... COMMIT       (no NOTIFY needed, nothing else to pay)
                 │ WAL
                 ▼
    walsender: pgoutput, publication router_wakeup (migration 0014): seq and target of every
                 │ row inserted into router_outbox_queue; a TEMPORARY slot, gone with the session
                 │ replication protocol (psycopg2: the only Python driver that speaks it)
                 ▼
    Follower:  'B' begin · 'R' relation · 'I' insert (its target) · … · 'C' commit
                 │ wake(targets) at each commit; standby status (flush LSN) after each commit
                 │ and every FEEDBACK_EVERY seconds, so the slot holds no WAL and
                 │ wal_sender_timeout never ends the session
                 ▼
    processors of those targets claim (the table stays the source of truth: the log only
    says when to look)

The follower runs on the event loop: psycopg2's asynchronous mode, its socket watched with
``loop.add_reader``, ``read_message()`` called when it is readable. A thread with
``call_soon_threadsafe`` would work as well, but could not be stopped while it waits in a
blocking read: cancelling the task and closing the connection is the whole shutdown here, and
the temporary slot goes with the connection.

What it needs from the server, which ``log_problem()`` checks before the store tries:
``wal_level = logical``, a role with REPLICATION (or a superuser), the publication, and
psycopg2 installed (``outbox-router[postgres-log]``); ``pg_hba.conf`` must also let the role
open a replication connection, and a slot and a walsender must be free
(``max_replication_slots``, ``max_wal_senders``), which only trying shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import secrets
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from envelopes import DatabaseError
from router._schema import WAKEUP_PUBLICATION
from router.relay.store.base import Echo, Wake, describe_error

__all__ = [
    "FEEDBACK_EVERY",
    "PUBLICATION",
    "SLOT_PREFIX",
    "Commit",
    "Decoder",
    "Follower",
    "LogLost",
    "log_problem",
]

PUBLICATION = WAKEUP_PUBLICATION
"""Made by ``router init-db`` (migration 0014) on every PostgreSQL database."""

SLOT_PREFIX = f"{WAKEUP_PUBLICATION}_"
"""Each follower's temporary slot is this (named after the publication it reads) and a random
suffix: several routers never share one."""

FEEDBACK_EVERY = 2.0
"""Seconds between standby status messages at the most, idle or not: far below the default
``wal_sender_timeout`` (60 s), and often enough that an idle slot never keeps old WAL."""

CONNECT_TIMEOUT = 10.0

EXTRA = "postgres-log"
"""The package extra that brings psycopg2 (``pip install 'outbox-router[postgres-log]'``)."""

# What the probe reads: the server's wal_level, whether the role may open a replication
# connection, and whether the publication exists.
PROBE = """
SELECT current_setting('wal_level'), current_user,
       (SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user),
       EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)
"""


class LogLost(DatabaseError):
    """The replication connection could not be opened, or ended: the log says nothing until
    the follower reconnects (commits made meanwhile are found by looking at the table)."""


async def log_problem(conn: Any) -> str | None:
    """Why this server cannot wake the relay from its log, with what to change; None when it
    can (as far as can be seen without trying). ``conn``: an asyncpg connection."""
    problems = []
    if importlib.util.find_spec("psycopg2") is None:
        problems.append(f"psycopg2 is not installed: pip install 'outbox-router[{EXTRA}]'")
    wal_level, user, may_replicate, published = await conn.fetchrow(PROBE, PUBLICATION)
    if wal_level != "logical":
        problems.append(
            f"wal_level is {wal_level}: set wal_level = logical (takes a server restart)"
        )
    if not may_replicate:
        problems.append(f"role {user} may not replicate: ALTER ROLE {user} REPLICATION")
    if not published:
        problems.append(f"publication {PUBLICATION} is missing: run `router init-db`")
    return "; ".join(problems) or None


@dataclass(frozen=True, slots=True)
class Commit:
    """One decoded transaction: the targets its inserts named (None: unknown, wake all) and
    the LSN just past its commit record, to confirm to the server."""

    targets: set[str] | None
    end_lsn: int


class Decoder:
    """pgoutput, protocol version 1, reduced to what a wake-up needs: the targets of each
    committed transaction's inserts. One method per message kind; kinds a wake-up has no use
    for ('Y' type, 'O' origin, 'T' truncate, 'U' update, 'D' delete, 'M' message) are read
    past."""

    def __init__(self) -> None:
        self._target_column: dict[int, int | None] = {}  # relation oid -> index of "target"
        self._targets: set[str] | None = set()
        self.in_transaction = False

    def feed(self, payload: bytes) -> Commit | None:
        """Take one message; returns the transaction when it was its commit."""
        kind = payload[:1]
        if kind == b"B":
            self._begin()
        elif kind == b"R":
            self._relation(payload)
        elif kind == b"I":
            self._insert(payload)
        elif kind == b"C":
            return self._commit(payload)
        return None

    def _begin(self) -> None:
        self._targets = set()
        self.in_transaction = True

    def _relation(self, payload: bytes) -> None:
        # Int32 oid, String namespace, String name, Int8 replica identity, Int16 columns, and
        # per column: Int8 flags, String name, Int32 type oid, Int32 type modifier.
        (oid,) = struct.unpack_from("!I", payload, 1)
        at = _skip_string(payload, _skip_string(payload, 5)) + 1
        (count,) = struct.unpack_from("!H", payload, at)
        at += 2
        column = None
        for index in range(count):
            end = payload.index(b"\0", at + 1)
            if payload[at + 1 : end] == b"target":
                column = index
            at = end + 1 + 8
        self._target_column[oid] = column

    def _insert(self, payload: bytes) -> None:
        # Int32 relation oid, Byte1 'N', TupleData.
        (oid,) = struct.unpack_from("!I", payload, 1)
        column = self._target_column.get(oid)
        target = None if column is None else _text_column(payload, 6, column)
        if target is None:
            self._targets = None  # a relation it cannot read: wake every target
        elif self._targets is not None:
            self._targets.add(target)

    def _commit(self, payload: bytes) -> Commit:
        # Int8 flags, Int64 commit LSN, Int64 end LSN, Int64 commit time.
        (end_lsn,) = struct.unpack_from("!Q", payload, 10)
        targets, self._targets = self._targets, set()
        self.in_transaction = False
        return Commit(targets, end_lsn)


def _skip_string(payload: bytes, at: int) -> int:
    """Where the bytes after the NUL-terminated string at ``at`` begin."""
    return payload.index(b"\0", at) + 1


def _text_column(payload: bytes, at: int, wanted: int) -> str | None:
    """Column ``wanted`` of the TupleData at ``at``, as text (None: null or not sent)."""
    (count,) = struct.unpack_from("!H", payload, at)
    at += 2
    for index in range(count):
        kind = payload[at : at + 1]
        at += 1
        if kind in (b"n", b"u"):  # null, unchanged TOAST: no value follows
            value = None
        else:  # b"t" text (b"b" binary needs protocol 2, which is not asked for)
            (length,) = struct.unpack_from("!I", payload, at)
            value = payload[at + 4 : at + 4 + length]
            at += 4 + length
        if index == wanted:
            return None if value is None else value.decode()
    return None


class Follower:
    """One replication connection with its temporary slot: ``start()`` opens it, ``run()``
    wakes on every commit until the connection ends (``LogLost``), ``close()`` ends it."""

    def __init__(self, dsn: str, wake: Wake, *, feedback_every: float = FEEDBACK_EVERY) -> None:
        self.slot = SLOT_PREFIX + secrets.token_hex(4)
        self._dsn = dsn
        # A commit reaches the log, and so this follower, a moment before its rows are
        # visible to other sessions: PostgreSQL flushes the commit record, which the walsender
        # may decode and send at once, and only then takes the transaction out of the running
        # ones that snapshots see (the randomised wake-up test lost 1 event in 120 that way).
        self._wake = Echo(wake)
        self._feedback_every = feedback_every
        self._decoder = Decoder()
        self._conn: Any = None
        self._cursor: Any = None
        self._confirmed = 0  # the LSN up to which the server was told all is done
        self._told_at = 0.0  # time.monotonic() of the last status message sent

    async def start(self) -> None:
        """Connect, create the slot, start streaming. Raises ``LogLost`` when the server
        refuses (wal_level, role, pg_hba.conf, no free slot or walsender) or is away."""
        try:
            import psycopg2
            import psycopg2.extras
        except ImportError as exc:
            missing = f"psycopg2 is not installed: pip install 'outbox-router[{EXTRA}]'"
            raise LogLost(missing) from exc
        try:
            self._conn = psycopg2.connect(
                self._dsn,
                connection_factory=psycopg2.extras.LogicalReplicationConnection,
                async_=True,
                application_name="router wakeup",
            )
            await asyncio.wait_for(_settle(self._conn), CONNECT_TIMEOUT)
            self._cursor = self._conn.cursor()
            # Waits for the transactions running now to end (a consistent point): the store
            # keeps LISTEN on meanwhile, so nothing committed before the slot is missed.
            self._cursor.execute(f"CREATE_REPLICATION_SLOT {self.slot} TEMPORARY LOGICAL pgoutput")
            await _settle(self._conn)
            self._cursor.start_replication(
                slot_name=self.slot,
                decode=False,
                options={"proto_version": "1", "publication_names": PUBLICATION},
                status_interval=self._feedback_every,
            )
            await _settle(self._conn)
        except (psycopg2.Error, OSError, TimeoutError) as exc:
            self.close()
            raise LogLost(describe_error(exc)) from exc
        except BaseException:  # cancelled (the router stops) while connecting
            self.close()
            raise

    async def run(self) -> NoReturn:
        """Wake on every commit that inserted rows; raises ``LogLost`` when the connection
        ends."""
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[Exception] = loop.create_future()
        fd = self._conn.fileno()

        # Read in the socket's own callback, not in a task woken by it: the server sends a
        # message for nearly every commit of the database (a keepalive for a transaction
        # without outbox rows), and a task's wake-up and a wait_for() per message cost
        # about as much as the decoding.
        def read() -> None:
            _step(ended, self._drain)

        def tell() -> None:  # the status message, every feedback_every, idle or not
            _step(ended, functools.partial(self._tell, force=True))
            timers[0] = loop.call_later(self._feedback_every, tell)

        timers = [loop.call_later(self._feedback_every, tell)]
        loop.add_reader(fd, read)
        try:
            read()  # what came before the reader was added
            raise await ended
        finally:
            loop.remove_reader(fd)
            timers[0].cancel()

    def _drain(self) -> None:
        """Read every message already here; wake for each commit."""
        while (message := self._cursor.read_message()) is not None:
            commit = self._decoder.feed(message.payload)
            if commit is None:
                continue
            if commit.targets is None or commit.targets:
                self._wake(commit.targets)
            self._confirmed = max(self._confirmed, commit.end_lsn)
            # psycopg2 sends a status it was only given (not forced) every status_interval:
            # one message per commit would double the traffic at thousands of commits a second.
            self._tell(force=time.monotonic() - self._told_at >= 1.0)

    def _tell(self, *, force: bool) -> None:
        """Confirm what was read. Between transactions, everything the server has sent is
        done with (the slot is temporary: nothing is ever read from it again), so the idle
        slot moves on with the server's WAL instead of holding it."""
        if not self._decoder.in_transaction:
            self._confirmed = max(self._confirmed, self._cursor.wal_end)
        self._cursor.send_feedback(flush_lsn=self._confirmed, force=force)
        if force:
            self._told_at = time.monotonic()

    def close(self) -> None:
        """End the session; the server drops the temporary slot with it."""
        self._wake.cancel()
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # a broken connection: nothing to keep
                conn.close()


def _step(ended: asyncio.Future[Exception], step: Callable[[], None]) -> None:
    """Run ``step`` unless ``ended``; a failure ends the follower's ``run()``, which raises
    it (a lost connection as ``LogLost``)."""
    import psycopg2

    if ended.done():
        return
    try:
        step()
    except (psycopg2.Error, OSError) as exc:
        lost = LogLost(describe_error(exc))
        lost.__cause__ = exc
        ended.set_result(lost)
    except Exception as exc:
        ended.set_result(exc)


async def _settle(conn: Any) -> None:
    """Drive an asynchronous psycopg2 connection until its current operation is done, waiting
    on its socket in the event loop. The socket is asked for on each turn: while connecting to
    a multi-host URL libpq may move on to another host's."""
    from psycopg2.extensions import POLL_OK, POLL_READ

    loop = asyncio.get_running_loop()
    while (state := conn.poll()) != POLL_OK:
        ready = loop.create_future()
        fd = conn.fileno()

        def done(future: asyncio.Future[None] = ready) -> None:
            if not future.done():
                future.set_result(None)

        if state == POLL_READ:
            loop.add_reader(fd, done)
            try:
                await ready
            finally:
                loop.remove_reader(fd)
        else:
            loop.add_writer(fd, done)
            try:
                await ready
            finally:
                loop.remove_writer(fd)
