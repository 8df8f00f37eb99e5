"""The databases a chaos run works on: one small class per kind, each of the same shape.

The run (``tests.chaos.chaos``) has one flow; what differs per database is here: making and
dropping the run's database, the URL the router gets, a producer connection that stages in a
transaction, the three reads the run makes (is this id committed, which rows are in flight,
how many are still open), ``crash()``, the server crash and its recovery, and ``cut_log()``,
which ends the relay's connections that follow the database's log (``wakeup: log``).

- ``Postgres``: a fresh database on a PostgreSQL server of the run's own
  (``tests.private_postgres``: the test session's, or one the run starts and removes), crashed
  with an immediate stop (no checkpoint, WAL not flushed) and restarted into crash recovery.
- ``Mariadb``: a private ``mariadbd`` the run starts on a free port with its datadir in the
  run's folder, killed with SIGKILL and started again on the same datadir (InnoDB crash
  recovery).

With ``log=True`` the server keeps a log the relay can follow: ``wal_level = logical``
(``LOGICAL_DECODING``) on PostgreSQL, the binlog in ROW format on MariaDB
(``tests.mariadb_binlog.binlog_options``).

The shared servers on 5432 and 3306 are never touched: crashing them would cut every other
test and session on the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import asyncmy
import asyncpg
from asyncmy.errors import MySQLError
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from router.relay.store.postgres_sql import RING_SLOTS
from tests.mariadb_binlog import binlog_options
from tests.private_postgres import LOGICAL_DECODING, PrivatePostgres, postgres_bin
from tests.services import free_port, program

__all__ = ["DATABASES", "ChaosDatabase", "Mariadb", "Postgres", "Producer", "chaos_database"]

CONNECT_TIMEOUT = 5


class Producer(ABC):
    """One producer's connection."""

    @abstractmethod
    def transaction(self) -> contextlib.AbstractAsyncContextManager[Any]:
        """A transaction, committed on leaving; yields what ``Outbox.stage`` takes."""

    @abstractmethod
    async def close(self) -> None:
        """Close after the last commit."""

    @abstractmethod
    async def abort(self) -> None:
        """Drop the connection after an error, whatever state it is in."""


class ChaosDatabase(ABC):
    """The run's database and the server it lives on."""

    kind: ClassVar[str]
    away: ClassVar[tuple[type[BaseException], ...]]
    """What the reads raise while the server is down or recovering."""
    commit_window: ClassVar[float]
    """How long before a crash a commit the router was told of may still be lost."""

    def __init__(self, folder: Path, *, log: bool = False) -> None:
        self.folder = folder
        self.log = log
        self.name = f"chaos_{uuid.uuid4().hex[:8]}"

    @property
    @abstractmethod
    def url(self) -> str:
        """The router's URL for the run's database."""

    @property
    @abstractmethod
    def sqlalchemy_url(self) -> str:
        """The same database as a SQLAlchemy async URL (for the inbox consumer)."""

    @abstractmethod
    async def create(self) -> None:
        """Make the run's (empty) database, starting its server if the run owns it."""

    @abstractmethod
    async def drop(self) -> None:
        """Drop the database and stop a server the run started; never raises."""

    @abstractmethod
    async def producer(self) -> Producer:
        """A new producer connection."""

    @abstractmethod
    async def exists(self, message_id: str) -> bool:
        """True when a row of ``message_id`` is committed."""

    @abstractmethod
    async def in_flight(self, holder: str, statuses: Sequence[str]) -> list[str]:
        """Ids of rows in ``statuses`` that are failed or leased by a ``holder`` (LIKE)."""

    @abstractmethod
    async def open_rows(self) -> int:
        """How many rows are not published yet."""

    @abstractmethod
    async def crash(self) -> None:
        """Crash the server and wait until it answers again, recovered."""

    @abstractmethod
    async def cut_log(self) -> int:
        """End every connection that follows the run's database's log (the relay's, one per
        worker), the server and the router staying up; returns how many were ended."""


# -- PostgreSQL -------------------------------------------------------------------------------


class PostgresProducer(Producer):
    """A raw asyncpg connection, as an application without SQLAlchemy stages."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[asyncpg.Connection]:
        """``conn.transaction()``; yields the connection."""
        async with self.conn.transaction():
            yield self.conn

    async def close(self) -> None:
        """Close the connection."""
        await self.conn.close()

    async def abort(self) -> None:
        """Terminate the connection."""
        self.conn.terminate()


class Postgres(ChaosDatabase):
    """A fresh database on a private PostgreSQL server: ``server`` (shared by the runs of a
    test session), or, without one, a server the run starts and removes."""

    kind = "postgresql"
    away = (
        OSError,
        TimeoutError,
        asyncpg.PostgresError,
        asyncpg.InterfaceError,
        asyncpg.InternalClientError,
    )
    # The router's claims and marks commit without waiting for the WAL flush (unless
    # outbox.durable_bookkeeping), which PostgreSQL does within 3 x wal_writer_delay (0.6 s
    # by default): a crash may forget those of its last moments. 2 s leaves room.
    commit_window = 2.0

    def __init__(
        self, folder: Path, server: PrivatePostgres | None = None, *, log: bool = False
    ) -> None:
        super().__init__(folder, log=log)
        self.owns_server = server is None
        self.server = server or PrivatePostgres(_postgres_programs())

    @property
    def url(self) -> str:
        """postgresql://postgres@127.0.0.1:<port>/<name>."""
        return self.server.url(self.name)

    @property
    def sqlalchemy_url(self) -> str:
        """postgresql+asyncpg://..."""
        return self.url.replace("postgresql://", "postgresql+asyncpg://", 1)

    async def create(self) -> None:
        """Start the server if the run owns it, then CREATE DATABASE with pgrowlocks (see
        ``in_flight``). With ``log``, a server given must have wal_level = logical already."""
        if self.owns_server:
            await self.server.create(settings=LOGICAL_DECODING if self.log else "")
            await self.server.start()
        elif self.log:
            [(wal_level,)] = await self._fetch_server("SHOW wal_level")
            if wal_level != "logical":
                raise RuntimeError(
                    f"the server given has wal_level = {wal_level}; a run on the log wake-up "
                    "needs one with LOGICAL_DECODING (the pg_logical fixture)"
                )
        await self.server.execute(f'CREATE DATABASE "{self.name}"')
        await self.server.execute("CREATE EXTENSION IF NOT EXISTS pgrowlocks", database=self.name)

    async def drop(self) -> None:
        """DROP DATABASE ... WITH (FORCE), or remove the whole server if the run owns it."""
        if self.owns_server:
            await self.server.close()
            return
        with contextlib.suppress(Exception):
            await self.server.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')

    async def producer(self) -> Producer:
        """A raw asyncpg connection."""
        return PostgresProducer(await asyncpg.connect(self.url, timeout=CONNECT_TIMEOUT))

    async def exists(self, message_id: str) -> bool:
        """One count by message_id."""
        rows = await self._fetch(
            "SELECT count(*) FROM router_outbox WHERE message_id = $1", message_id
        )
        return bool(rows[0][0])

    async def in_flight(self, holder: str, statuses: Sequence[str]) -> list[str]:
        """The ids as text. A batch writes nothing on the rows it publishes (they stay
        'pending', locked by its transaction, whose session is named after its worker): the
        rows a ``holder`` session has locked now, read with pgrowlocks (which takes no lock
        on them); and the failed ones when ``statuses`` has 'failed'."""
        # Unfinished rows are in the queue's slots (migration 0011), each a table of its own.
        locked = " UNION ".join(
            f"SELECT o.message_id::text FROM pgrowlocks('router_outbox_q{slot}') l"
            f" JOIN router_outbox_q{slot} o ON o.ctid = l.locked_row"
            " WHERE EXISTS (SELECT 1 FROM pg_stat_activity a"
            "               WHERE a.pid = ANY(l.pids) AND a.application_name LIKE $1)"
            for slot in range(RING_SLOTS)
        )
        rows = await self._fetch(
            f"{locked} UNION SELECT message_id::text FROM router_outbox"
            " WHERE status = 'failed' AND 'failed' = ANY($2::text[])",
            holder,
            list(statuses),
        )
        return [row[0] for row in rows]

    async def open_rows(self) -> int:
        """Rows whose status is not 'published'."""
        rows = await self._fetch("SELECT count(*) FROM router_outbox WHERE status <> 'published'")
        return int(rows[0][0])

    async def crash(self) -> None:
        """``pg_ctl restart -m immediate`` of the private server: returns once recovery is
        done."""
        await self.server.crash()

    async def cut_log(self) -> int:
        """``pg_terminate_backend`` of the walsenders streaming the run's database (not
        another test's on a shared server): each takes its temporary slot with it."""
        rows = await self._fetch(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE backend_type = 'walsender' AND datname = $1",
            self.name,
        )
        return sum(1 for (ended,) in rows if ended)

    async def _fetch(self, query: str, *args: Any) -> list[Any]:
        return await self._fetch_server(query, *args, database=self.name)

    async def _fetch_server(self, query: str, *args: Any, database: str = "postgres") -> list[Any]:
        conn = await asyncpg.connect(self.server.url(database), timeout=CONNECT_TIMEOUT)
        try:
            return list(await conn.fetch(query, *args))
        finally:
            await conn.close()


# -- MariaDB ----------------------------------------------------------------------------------

MARIADB_PROGRAMS = ("mariadbd", "mariadb-install-db")
# Small and quick to start and recover. innodb_flush_log_at_trx_commit=1 (the default, written
# out because the run depends on it): a commit is flushed to the redo log before the client
# hears of it. The store's claims and marks are autocommit statements
# (router/relay/store/mysql.py), so none the router was told of is lost in a crash: no
# commit window, unlike PostgreSQL's asynchronous commits. A server run with 0 (or 2, for a
# machine crash) would forget up to a second of them, like PostgreSQL does.
INNODB = (
    "--innodb-buffer-pool-size=32M",
    "--innodb-log-file-size=16M",
    "--innodb-log-buffer-size=4M",
    "--innodb-data-file-path=ibdata1:12M:autoextend",
    "--innodb-flush-log-at-trx-commit=1",
)
START_TIMEOUT = 60.0


class MariadbServer:
    """A private ``mariadbd``: its own datadir, socket and port, started and killed by pid;
    with ``log``, its binlog on as a router's follower needs it."""

    def __init__(self, folder: Path, *, log: bool = False) -> None:
        self.folder = folder
        self.binlog = binlog_options(folder) if log else ()
        self.datadir = folder / "data"
        self.port = free_port()
        self.log = folder / "mariadbd.log"
        self.socket = _socket_path(folder)
        self.process: subprocess.Popen[bytes] | None = None

    async def install(self) -> None:
        """``mariadb-install-db``: system tables, root@127.0.0.1 without a password."""
        self.folder.mkdir(parents=True, exist_ok=True)
        command = [
            _program("mariadb-install-db"),
            "--no-defaults",
            f"--datadir={self.datadir}",
            "--auth-root-authentication-method=normal",
            "--skip-test-db",
            "--skip-name-resolve",
            *_as_user(),
            *INNODB,
        ]
        result = await asyncio.to_thread(
            subprocess.run, command, capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise RuntimeError(f"mariadb-install-db failed: {result.stdout}{result.stderr}")

    async def start(self) -> None:
        """Start on the datadir (recovering it after a kill) and wait until it answers."""
        self._spawn()
        await self._answering()

    def kill(self) -> None:
        """SIGKILL, as a crash: no shutdown, no flush of dirty pages."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        """A clean shutdown (SIGTERM), a kill if it takes longer than 30 s."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()

    async def connect(self, database: str | None = None) -> Any:
        """An autocommit asyncmy connection as root."""
        return await asyncmy.connect(
            host="127.0.0.1",
            port=self.port,
            user="root",
            database=database,
            autocommit=True,
            connect_timeout=CONNECT_TIMEOUT,
        )

    async def _answering(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mariadbd exited at start: {self._log_tail()}")
            with contextlib.suppress(MySQLError, OSError, TimeoutError):
                conn = await self.connect()
                await conn.ensure_closed()
                return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"mariadbd did not answer in {START_TIMEOUT:.0f} s: {self._log_tail()}")

    def _spawn(self) -> None:
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    _program("mariadbd"),
                    "--no-defaults",
                    f"--datadir={self.datadir}",
                    f"--socket={self.socket}",
                    f"--pid-file={self.folder / 'mariadbd.pid'}",
                    f"--port={self.port}",
                    "--bind-address=127.0.0.1",
                    "--skip-name-resolve",
                    "--performance-schema=OFF",
                    f"--log-error={self.log}",
                    *_as_user(),
                    *INNODB,
                    *self.binlog,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C reaches the run, which stops it
            )

    def _log_tail(self) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-15:])
        except OSError:
            return "(no log)"


class MariadbProducer(Producer):
    """A SQLAlchemy AsyncConnection, as most applications stage."""

    def __init__(self, conn: AsyncConnection) -> None:
        self.conn = conn

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncConnection]:
        """``conn.begin()``; yields the connection."""
        async with self.conn.begin():
            yield self.conn

    async def close(self) -> None:
        """Close the connection."""
        await self.conn.close()

    async def abort(self) -> None:
        """Invalidate the connection (the driver's socket is closed) and let it go."""
        with contextlib.suppress(Exception):
            await self.conn.invalidate()
        with contextlib.suppress(Exception):
            await self.conn.close()


class Mariadb(ChaosDatabase):
    """A database on a MariaDB server of the run's own, in ``folder``."""

    kind = "mysql"
    away = (OSError, TimeoutError, MySQLError, SQLAlchemyError)
    commit_window = 0.0  # see INNODB

    def __init__(self, folder: Path, *, log: bool = False) -> None:
        super().__init__(folder, log=log)
        self.server = MariadbServer(folder / "mariadb", log=log)
        self._engine: AsyncEngine | None = None

    @property
    def url(self) -> str:
        """mysql://root@127.0.0.1:<port>/<name>."""
        return f"mysql://root@127.0.0.1:{self.server.port}/{self.name}"

    @property
    def sqlalchemy_url(self) -> str:
        """mysql+asyncmy://...?charset=utf8mb4."""
        return self.url.replace("mysql://", "mysql+asyncmy://", 1) + "?charset=utf8mb4"

    async def create(self) -> None:
        """Install and start the server, then CREATE DATABASE."""
        await self.server.install()
        await self.server.start()
        conn = await self.server.connect()
        try:
            async with conn.cursor() as cursor:
                await cursor.execute(f"CREATE DATABASE `{self.name}`")
        finally:
            await conn.ensure_closed()

    async def drop(self) -> None:
        """Stop the server; its datadir goes with the run's folder."""
        if self._engine is not None:
            with contextlib.suppress(Exception):
                await self._engine.dispose()
        self.server.stop()

    async def producer(self) -> Producer:
        """A new SQLAlchemy connection (no pool: a broken one is simply dropped)."""
        if self._engine is None:
            self._engine = create_async_engine(
                self.sqlalchemy_url,
                poolclass=NullPool,
                connect_args={"connect_timeout": CONNECT_TIMEOUT},
            )
        return MariadbProducer(await self._engine.connect())

    async def exists(self, message_id: str) -> bool:
        """One count by message_id."""
        rows = await self._fetch(
            "SELECT count(*) FROM router_outbox WHERE message_id = %s", [message_id]
        )
        return bool(rows[0][0])

    async def in_flight(self, holder: str, statuses: Sequence[str]) -> list[str]:
        """The ids."""
        marks = ", ".join(["%s"] * len(statuses))
        rows = await self._fetch(
            f"SELECT message_id FROM router_outbox WHERE status IN ({marks}) "
            "AND (status = 'failed' OR locked_by LIKE %s)",
            [*statuses, holder],
        )
        return [row[0] for row in rows]

    async def open_rows(self) -> int:
        """Rows whose status is not 'published'."""
        rows = await self._fetch("SELECT count(*) FROM router_outbox WHERE status <> 'published'")
        return int(rows[0][0])

    async def crash(self) -> None:
        """SIGKILL mariadbd, start it again on the same datadir; returns once it answers."""
        self.server.kill()
        await self.server.start()

    async def cut_log(self) -> int:
        """``KILL`` of every 'Binlog Dump' thread: the server is the run's own, so each is
        one of the relay's followers."""
        conn = await self.server.connect()
        cut = 0
        try:
            async with conn.cursor() as cursor:
                await cursor.execute("SHOW PROCESSLIST")
                dumps = [row[0] for row in await cursor.fetchall() if row[4] == "Binlog Dump"]
                for thread in dumps:
                    with contextlib.suppress(MySQLError):  # ended on its own meanwhile
                        await cursor.execute(f"KILL {int(thread)}")
                        cut += 1
        finally:
            await conn.ensure_closed()
        return cut

    async def _fetch(self, query: str, args: Sequence[Any] = ()) -> list[Any]:
        conn = await self.server.connect(self.name)
        try:
            async with conn.cursor() as cursor:
                await cursor.execute(query, list(args))
                return list(await cursor.fetchall())
        finally:
            await conn.ensure_closed()


DATABASES: dict[str, type[ChaosDatabase]] = {"postgresql": Postgres, "mysql": Mariadb}


def chaos_database(
    kind: str, folder: Path, postgres: PrivatePostgres | None = None, *, log: bool = False
) -> ChaosDatabase:
    """The run's database of ``kind`` ('postgresql' or 'mysql'), its files under ``folder``;
    on PostgreSQL, on the ``postgres`` server when given (else on one of the run's own); with
    ``log``, on a server whose log the relay can follow."""
    if kind == "postgresql":
        return Postgres(folder, postgres, log=log)
    return DATABASES[kind](folder, log=log)


def _postgres_programs() -> Path:
    found = postgres_bin()
    if found is None:
        raise RuntimeError(
            "PostgreSQL's server programs are not installed (apt-get install postgresql)"
        )
    return found


def _program(name: str) -> str:
    found = program(name)
    if found is None:
        raise RuntimeError(f"{name} is not installed (the mariadb-server package has it)")
    return found


def _as_user() -> list[str]:
    # mariadbd refuses to run as root unless told to; as anyone else it runs as that user.
    return ["--user=root"] if os.geteuid() == 0 else []


def _socket_path(folder: Path) -> str:
    """A socket in the server's folder, or in /tmp when that path is too long for one (no
    client uses it, but mariadbd always listens on one, and the default is the shared
    server's)."""
    path = folder / "mariadbd.sock"
    if len(str(path)) < 100:  # sun_path holds 108 bytes
        return str(path)
    return f"/tmp/chaos-mariadbd-{uuid.uuid4().hex[:12]}.sock"
