"""A PostgreSQL primary and its streaming replica, of a test's own, for failover tests.

Both run from the installed PostgreSQL's programs on free loopback ports, with their data in
a temporary folder. The replica streams from the primary through a proxy (``link``), which
can hold the WAL back for a while (``hold_replication()``, a slow or cut network).
``stop_primary()`` stops the primary as a crash of its host would: ``pg_ctl stop -m
immediate``, and the WAL the replica had not received yet is gone with it. ``promote()``
promotes the replica. ``close()`` stops both and removes the folder, whatever happened
before. The shared server on 5432 is never touched.

initdb refuses to run as root: as root, every program runs as the ``postgres`` user (through
``runuser``), in a folder that user owns; as anyone else, as that user.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import asyncpg
import pytest

from tests.chaos.proxy import DelayingProxy
from tests.services import free_port, in_ci

__all__ = ["PG_PROGRAMS", "ReplicatedPostgres", "postgres_bin", "require_postgres_programs"]

PG_PROGRAMS = ("initdb", "pg_ctl", "pg_basebackup")
PG_USER = "postgres"
DATABASE = "outbox"
START_TIMEOUT = 30.0

# The primary's settings. fsync off: the tests crash the server process, never the machine,
# so what a commit wrote is in the page cache either way, and a shared test machine is spared
# the flushes. Replication is what decides what a promoted replica has.
PRIMARY_CONF = """
listen_addresses = '127.0.0.1'
port = {port}
unix_socket_directories = '{sockets}'
wal_level = replica
max_wal_senders = 4
hot_standby = on
fsync = off
full_page_writes = off
shared_buffers = 16MB
max_connections = 40
synchronous_commit = on
"""
# The replica starts from a copy of the primary's files (its settings too): its own port.
REPLICA_CONF = """
port = {port}
"""
# In postgresql.auto.conf, after what pg_basebackup -R wrote there: stream through the link.
REPLICA_SOURCE = (
    "primary_conninfo = 'host=127.0.0.1 port={port} user=postgres application_name=replica'\n"
)
# Made synchronous once the replica streams (a commit before that would wait for it), in the
# primary's postgresql.auto.conf, which the replica's copy was taken without: promoted, it has
# no synchronous standby of its own, or every commit would wait forever.
SYNCHRONOUS = "ALTER SYSTEM SET synchronous_standby_names = '*'"
HBA_REPLICATION = "host replication all 127.0.0.1/32 trust\n"


def postgres_bin() -> Path | None:
    """The folder of the newest installed PostgreSQL's server programs (Debian's layout, or
    wherever ``pg_config --bindir`` says)."""
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3])
    )
    if versions:
        return versions[-1].parent
    pg_config = shutil.which("pg_config")
    if pg_config is None:
        return None
    found = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
    folder = Path(found.stdout.strip())
    return folder if (folder / "initdb").exists() else None


def require_postgres_programs() -> Path:
    """The server programs' folder; fails (CI) or skips (laptop) when they are missing."""
    folder = postgres_bin()
    installed = folder is not None and all((folder / name).exists() for name in PG_PROGRAMS)
    if installed and (os.geteuid() != 0 or _has_user(PG_USER)):
        assert folder is not None
        return folder
    message = (
        "a primary and a replica of the test's own need PostgreSQL's server programs "
        f"({', '.join(PG_PROGRAMS)}) and, as root, a '{PG_USER}' user: "
        "apt-get install postgresql"
    )
    if in_ci():
        pytest.fail(message)
    pytest.skip(message)


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


class ReplicatedPostgres:
    """A primary and a streaming replica (asynchronous, or synchronous: a commit returns once
    the replica has flushed it)."""

    def __init__(self, bin_folder: Path, *, synchronous: bool = False) -> None:
        self.bin = bin_folder
        self.synchronous = synchronous
        self.folder = Path(tempfile.mkdtemp(prefix="router-failover-"))
        self.primary = self.folder / "primary"
        self.replica = self.folder / "replica"
        self.primary_port = free_port()
        self.replica_port = free_port()
        self.link = DelayingProxy("127.0.0.1", self.primary_port, delay=0.0)
        self._chown(self.folder)

    def url(self, password: str | None = None, *, replica_first: bool = False) -> str:
        """The multi-host URL of the pair's database: the primary first, then the replica
        (or the other way round)."""
        user = f"{PG_USER}:{password}" if password else PG_USER
        ports = [self.primary_port, self.replica_port]
        hosts = ",".join(f"127.0.0.1:{port}" for port in (ports[::-1] if replica_first else ports))
        return f"postgresql://{user}@{hosts}/{DATABASE}?target_session_attrs=read-write"

    def primary_url(self) -> str:
        """The primary alone (the pair's database)."""
        return f"postgresql://{PG_USER}@127.0.0.1:{self.primary_port}/{DATABASE}"

    def replica_url(self) -> str:
        """The replica alone (the pair's database)."""
        return f"postgresql://{PG_USER}@127.0.0.1:{self.replica_port}/{DATABASE}"

    async def start(self, template: Path | None = None) -> None:
        """initdb (or copy ``template``, a fresh initdb's folder), start the primary, make the
        replica with ``pg_basebackup -R``, start it, and wait until it streams (and, when
        synchronous, counts as the synchronous standby)."""
        if template is not None:
            await self._run("cp", "-a", str(template), str(self.primary))
        else:
            await self.initdb(self.primary, self.bin)
        self._append(
            self.primary / "postgresql.conf",
            PRIMARY_CONF.format(port=self.primary_port, sockets=self.folder),
        )
        self._append(self.primary / "pg_hba.conf", HBA_REPLICATION)
        await self._pg_ctl(self.primary, "start")
        await self._create_database()
        await self._run(
            str(self.bin / "pg_basebackup"),
            *("-h", "127.0.0.1", "-p", str(self.primary_port), "-U", PG_USER),
            *("-D", str(self.replica), "-R", "-X", "stream", "-c", "fast"),
        )
        self._append(self.replica / "postgresql.conf", REPLICA_CONF.format(port=self.replica_port))
        await self.link.start()
        self._append(
            self.replica / "postgresql.auto.conf", REPLICA_SOURCE.format(port=self.link.port)
        )
        await self._pg_ctl(self.replica, "start")
        await self._streaming("async")
        if self.synchronous:
            await self._on_primary(SYNCHRONOUS, "SELECT pg_reload_conf()")
            await self._streaming("sync")

    @classmethod
    async def initdb(cls, folder: Path, bin_folder: Path) -> None:
        """A fresh cluster in ``folder`` (trust authentication, no fsync of its files)."""
        folder.parent.mkdir(parents=True, exist_ok=True)
        cls._chown(folder.parent)
        await cls._run(
            str(bin_folder / "initdb"), "-N", "-A", "trust", "-U", PG_USER, "-D", str(folder)
        )

    def hold_replication(self) -> None:
        """The link stops forwarding (the connection stays open): the replica falls behind."""
        self.link.hold()

    async def stop_primary(self) -> None:
        """Stop the primary as a crash of its host would: no shutdown checkpoint, connections
        cut, and the WAL still on its way to the replica lost."""
        await self._pg_ctl(self.primary, "stop", "-m", "immediate")
        await self.link.stop()

    async def promote(self) -> None:
        """Promote the replica; returns once it accepts writes."""
        await self._pg_ctl(self.replica, "promote")

    async def close(self) -> None:
        """Stop both servers (immediately) and remove the folder; never raises."""
        with contextlib.suppress(Exception):
            await self.link.stop()
        for data in (self.replica, self.primary):
            if (data / "postmaster.pid").exists():
                with contextlib.suppress(Exception):
                    await self._pg_ctl(data, "stop", "-m", "immediate")
        shutil.rmtree(self.folder, ignore_errors=True)

    async def _create_database(self) -> None:
        await self._on_primary(f'CREATE DATABASE "{DATABASE}"')

    async def _on_primary(self, *statements: str) -> None:
        conn = await self._connect(self.primary_port, "postgres")
        try:
            for statement in statements:
                await conn.execute(statement)
        finally:
            await conn.close()

    async def _streaming(self, want: str) -> None:
        """Wait until the primary sees the replica streaming, as an ``want`` standby."""
        deadline = time.monotonic() + START_TIMEOUT
        conn = await self._connect(self.primary_port, "postgres")
        try:
            while time.monotonic() < deadline:
                state = await conn.fetchval(
                    "SELECT sync_state FROM pg_stat_replication WHERE state = 'streaming'"
                )
                if state == want:
                    return
                await asyncio.sleep(0.05)
        finally:
            await conn.close()
        raise RuntimeError(f"the replica is not streaming ({want}) after {START_TIMEOUT:.0f} s")

    @staticmethod
    async def _connect(port: int, database: str) -> asyncpg.Connection:
        return await asyncpg.connect(
            f"postgresql://{PG_USER}@127.0.0.1:{port}/{database}", timeout=10
        )

    async def _pg_ctl(self, data: Path, action: str, *options: str) -> None:
        log = data.parent / f"{data.name}.log"
        await self._run(
            str(self.bin / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", *options, action
        )

    @staticmethod
    async def _run(*command: str) -> None:
        as_user = ["runuser", "-u", PG_USER, "--"] if os.geteuid() == 0 else []
        result = await asyncio.to_thread(
            subprocess.run,
            [*as_user, *command],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        if result.returncode != 0:
            name = Path(command[0]).name
            raise RuntimeError(f"{name} failed ({result.returncode}): {result.stderr.strip()}")

    @staticmethod
    def _chown(path: Path) -> None:
        if os.geteuid() == 0:
            user = pwd.getpwnam(PG_USER)
            os.chown(path, user.pw_uid, user.pw_gid)

    @staticmethod
    def _append(path: Path, text: str) -> None:
        # Written as root into the postgres user's file: appending keeps its owner and mode.
        with path.open("a") as file:
            file.write(text)
