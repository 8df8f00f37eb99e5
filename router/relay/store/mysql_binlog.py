"""The MySQL/MariaDB binlog as a wake-up signal: inserts into ``router_outbox`` wake the relay.

Only a signal: the table stays the source of truth, and nothing read here is delivered. A
``BinlogFollower`` connects as a replica would (``COM_BINLOG_DUMP``, through the
``mysql-replication`` package, imported only here), from the binlog's end at that moment, and
for each ``WriteRowsEvent`` on this database's ``router_outbox`` tells the event loop which
targets got rows (the ``target`` column of the row image; nothing else is kept). Its reads
block, so a session runs in a thread of its own and calls back with
``loop.call_soon_threadsafe``. A session ends when its connection does: the store then polls
until the next one connects.

What the server must allow (``binlog_problem`` checks the first two): ``log_bin`` on,
``binlog_format=ROW``, and a user with ``REPLICATION SLAVE`` and ``REPLICATION CLIENT``
(``BINLOG MONITOR`` on MariaDB 10.5+). A replica needs a ``server_id`` no other replica of the
server uses, or the server drops the older one: each session takes a random one from
``SERVER_IDS``, far above the ids people give their servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
from collections.abc import Callable
from typing import Any

import pymysql

from envelopes import DatabaseError
from router._schema import OUTBOX
from router.relay.store.base import Echo, Wake, describe_error

__all__ = [
    "BINLOG_STATUS",
    "GRANT",
    "SERVER_IDS",
    "BinlogFollower",
    "BinlogUnusable",
    "binlog_problem",
    "denied",
    "follower_server_id",
]

log = logging.getLogger(__name__)

SERVER_IDS = (3_000_000_000, 4_294_967_295)
"""The range a follower's ``server_id`` is drawn from (the top of the 32-bit ids)."""
GRANT = "GRANT REPLICATION SLAVE, REPLICATION CLIENT ON *.* TO the router's user"

HEARTBEAT = 1.0  # the server sends one when it has nothing else: how often a session looks up
READ_TIMEOUT = 5.0  # no byte for this long (not even a heartbeat): the connection is lost

BINLOG_STATUS = ("SHOW MASTER STATUS", "SHOW BINARY LOG STATUS")
"""The binlog's end: the first form everywhere but MySQL 8.4+, which knows only the second."""

_ACCESS_DENIED = (1045, 1227)  # a login refused; a privilege missing
_PARSE_ERROR = 1064


class BinlogUnusable(Exception):
    """The server does not let the router follow its binlog; ``str()`` says what to change."""


def follower_server_id() -> int:
    """A random replica ``server_id`` in ``SERVER_IDS``: two followers never meet in practice."""
    low, high = SERVER_IDS
    return low + secrets.randbelow(high - low + 1)


def binlog_problem(
    log_bin: object, binlog_format: object, status: tuple[Any, ...] | None
) -> str | None:
    """What keeps the binlog from waking the relay, from ``@@log_bin``, ``@@binlog_format``
    and the first row of ``SHOW MASTER STATUS`` (None: nothing)."""
    if not log_bin or status is None:
        return f"binlog is off: set log_bin and binlog_format=ROW, and {GRANT}"
    if str(binlog_format).upper() != "ROW":
        return f"binlog_format is {binlog_format}: set binlog_format=ROW"
    return None


def denied(exc: BaseException) -> str | None:
    """What to grant, when ``exc`` (a PyMySQL or asyncmy error) is the server refusing the
    router's user; None for any other error."""
    code = exc.args[0] if exc.args and isinstance(exc.args[0], int) else None
    if code not in _ACCESS_DENIED:
        return None
    return f"the router's user may not read the binlog ({describe_error(exc)}): {GRANT}"


class BinlogFollower:
    """Follows one database's binlog, a session (one connection) at a time."""

    def __init__(self, name: str, connect_args: dict[str, Any]) -> None:
        self.name = name
        self.database = str(connect_args.get("database") or "")
        self.settings: dict[str, Any] = {
            "host": connect_args.get("host", "127.0.0.1"),
            "port": int(connect_args.get("port", 3306)),
            "user": connect_args.get("user", "root"),
            "password": connect_args.get("password", ""),
            "connect_timeout": 10,
            "read_timeout": READ_TIMEOUT,
        }
        """PyMySQL's connect arguments, for both of a session's connections."""
        if "unix_socket" in connect_args:
            self.settings["unix_socket"] = connect_args["unix_socket"]

    async def follow(self, rows: Wake, connected: Callable[[], None]) -> None:
        """Run one session: ``connected()`` once the server streams, then ``rows(targets)``
        for each insert into ``router_outbox`` (``None``: targets unknown), until the
        connection is lost (``DatabaseError``) or refused (``BinlogUnusable``). Cancelled, the
        session's thread ends at its next heartbeat."""
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[None] = loop.create_future()
        stop = threading.Event()

        # The server may send a transaction's events a moment before its commit is visible
        # to other sessions (the binlog is written first): a claim made at once could miss
        # the rows, so the processors look once more shortly after (``Echo``).
        arrived = Echo(rows)
        session = _Session(self, loop, arrived, connected, stop, ended)
        threading.Thread(target=session.run, name=f"binlog:{self.name}", daemon=True).start()
        try:
            await ended
        finally:
            stop.set()
            arrived.cancel()


class _Session:
    """One binlog connection, read in its own thread."""

    def __init__(
        self,
        follower: BinlogFollower,
        loop: asyncio.AbstractEventLoop,
        rows: Wake,
        connected: Callable[[], None],
        stop: threading.Event,
        ended: asyncio.Future[None],
    ) -> None:
        self.follower = follower
        self.loop = loop
        self.rows = rows
        self.connected = connected
        self.stop = stop
        self.ended = ended
        self._streams = 0

    def run(self) -> None:
        """Read until stopped or the connection ends; tell the loop how it ended."""
        error: BaseException | None = None
        try:
            self._read()
        except BinlogUnusable as exc:
            error = exc
        except Exception as exc:  # pymysql's, a socket's, the package's: all end the session
            problem = denied(exc)
            error = BinlogUnusable(problem) if problem else self._lost(exc)
        self._post(self._end, error)

    def _read(self) -> None:
        from pymysqlreplication import BinLogStreamReader
        from pymysqlreplication.event import HeartbeatLogEvent, RotateEvent
        from pymysqlreplication.row_event import WriteRowsEvent

        log_file, log_pos = self._end_of_binlog()
        stream = BinLogStreamReader(
            connection_settings=dict(self.follower.settings),
            server_id=follower_server_id(),
            blocking=True,
            resume_stream=True,
            log_file=log_file,
            log_pos=log_pos,
            only_events=[WriteRowsEvent, RotateEvent, HeartbeatLogEvent],
            only_schemas=[self.follower.database],
            only_tables=[OUTBOX],
            slave_heartbeat=HEARTBEAT,
            use_column_name_cache=True,  # column names without binlog_row_metadata=FULL
            enable_logging=False,
            pymysql_wrapper=self._connect,
        )
        try:
            announced = False
            while not self.stop.is_set():
                event = stream.fetchone()
                if event is None:
                    raise DatabaseError(f"{self.follower.name}: the server ended the binlog")
                if not announced:  # the server's first event, a rotate: it streams
                    announced = True
                    self._post(self.connected)
                if isinstance(event, WriteRowsEvent):
                    self._post(self.rows, _targets(event.rows))
        finally:
            with contextlib.suppress(Exception):
                stream.close()

    def _end_of_binlog(self) -> tuple[str, int]:
        """The binlog's current file and position (``SHOW MASTER STATUS``), after checking
        the server writes a binlog the follower can use."""
        conn = pymysql.connect(**self.follower.settings)
        try:
            with conn.cursor() as cursor:
                cursor.execute("SELECT @@log_bin, @@binlog_format")
                log_bin, binlog_format = cursor.fetchone()
                status = _binlog_status(cursor)
        finally:
            conn.close()
        problem = binlog_problem(log_bin, binlog_format, status)
        if problem is not None or status is None:
            raise BinlogUnusable(problem or "no binlog")
        return str(status[0]), int(status[1])

    def _connect(self, **settings: Any) -> Any:
        # The package reconnects on its own when its stream connection drops, from where it
        # was. A lost connection must end the session instead, so the store polls meanwhile.
        if settings.get("db") != "information_schema":
            self._streams += 1
            if self._streams > 1:
                raise DatabaseError(f"{self.follower.name}: binlog connection lost")
        return pymysql.connect(**settings)

    def _lost(self, exc: BaseException) -> DatabaseError:
        if isinstance(exc, DatabaseError):
            return exc
        return DatabaseError(f"{self.follower.name}: binlog: {describe_error(exc)}")

    def _end(self, error: BaseException | None) -> None:
        if self.ended.done():
            return
        if error is None:
            self.ended.set_result(None)
        else:
            self.ended.set_exception(error)

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens any more
            self.loop.call_soon_threadsafe(callback, *args)


def _binlog_status(cursor: Any) -> tuple[Any, ...] | None:
    """The first row of ``SHOW MASTER STATUS`` (``SHOW BINARY LOG STATUS`` on MySQL 8.4+)."""
    try:
        cursor.execute(BINLOG_STATUS[0])
    except pymysql.err.ProgrammingError as exc:
        if not exc.args or exc.args[0] != _PARSE_ERROR:
            raise
        cursor.execute(BINLOG_STATUS[1])
    row = cursor.fetchone()
    return tuple(row) if row else None


def _targets(rows: list[dict[str, Any]]) -> set[str] | None:
    """The targets of inserted rows, from each row image's ``target`` (None: one lacks it)."""
    targets = set()
    for row in rows:
        target = row.get("values", {}).get("target")
        if not isinstance(target, str):
            return None
        targets.add(target)
    return targets
