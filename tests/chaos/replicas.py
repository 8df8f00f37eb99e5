"""A PostgreSQL primary and its streaming replica, of a test's own, for failover tests.

Both run from the installed PostgreSQL's programs on free loopback ports, with their data in
a temporary folder. The replica streams from the primary through a proxy (``link``), which
can hold the WAL back for a while (``hold_replication()``, a slow or cut network).
``stop_primary()`` stops the primary as a crash of its host would: ``pg_ctl stop -m
immediate``, and the WAL the replica had not received yet is gone with it. ``promote()``
promotes the replica. ``close()`` stops both and removes the folder, whatever happened
before. The shared server on 5432 is never touched.

The servers themselves are ``tests.private_postgres.PrivatePostgres``.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from pathlib import Path

import asyncpg

from tests.chaos.proxy import DelayingProxy
from tests.private_postgres import (
    PG_PROGRAMS,
    PG_USER,
    PrivatePostgres,
    append,
    postgres_bin,
    require_postgres_programs,
    run_as_server_user,
)

__all__ = ["PG_PROGRAMS", "ReplicatedPostgres", "postgres_bin", "require_postgres_programs"]

DATABASE = "outbox"
START_TIMEOUT = 30.0

# The primary's settings, after PrivatePostgres's own. Replication is what decides what a
# promoted replica has.
PRIMARY_CONF = """
wal_level = replica
max_wal_senders = 4
hot_standby = on
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


class ReplicatedPostgres:
    """A primary and a streaming replica (asynchronous, or synchronous: a commit returns once
    the replica has flushed it)."""

    def __init__(self, bin_folder: Path, *, synchronous: bool = False) -> None:
        self.bin = bin_folder
        self.synchronous = synchronous
        self.folder = Path(tempfile.mkdtemp(prefix="router-failover-"))
        self.primary = PrivatePostgres(bin_folder, self.folder, "primary")
        self.replica = PrivatePostgres(bin_folder, self.folder, "replica")
        self.primary_port = self.primary.port
        self.replica_port = self.replica.port
        self.link = DelayingProxy("127.0.0.1", self.primary_port, delay=0.0)

    def url(self, password: str | None = None, *, replica_first: bool = False) -> str:
        """The multi-host URL of the pair's database: the primary first, then the replica
        (or the other way round)."""
        user = f"{PG_USER}:{password}" if password else PG_USER
        ports = [self.primary_port, self.replica_port]
        hosts = ",".join(f"127.0.0.1:{port}" for port in (ports[::-1] if replica_first else ports))
        return f"postgresql://{user}@{hosts}/{DATABASE}?target_session_attrs=read-write"

    def primary_url(self) -> str:
        """The primary alone (the pair's database)."""
        return self.primary.url(DATABASE)

    def replica_url(self) -> str:
        """The replica alone (the pair's database)."""
        return self.replica.url(DATABASE)

    async def start(self, template: Path | None = None) -> None:
        """initdb (or copy ``template``, a fresh initdb's folder), start the primary, make the
        replica with ``pg_basebackup -R``, start it, and wait until it streams (and, when
        synchronous, counts as the synchronous standby)."""
        await self.primary.create(template, PRIMARY_CONF)
        append(self.primary.data / "pg_hba.conf", HBA_REPLICATION)
        await self.primary.start()
        await self.primary.execute(f'CREATE DATABASE "{DATABASE}"')
        await run_as_server_user(
            str(self.bin / "pg_basebackup"),
            *("-h", "127.0.0.1", "-p", str(self.primary_port), "-U", PG_USER),
            *("-D", str(self.replica.data), "-R", "-X", "stream", "-c", "fast"),
        )
        append(self.replica.data / "postgresql.conf", REPLICA_CONF.format(port=self.replica_port))
        await self.link.start()
        append(
            self.replica.data / "postgresql.auto.conf", REPLICA_SOURCE.format(port=self.link.port)
        )
        await self.replica.start()
        await self._streaming("async")
        if self.synchronous:
            await self.primary.execute(SYNCHRONOUS, "SELECT pg_reload_conf()")
            await self._streaming("sync")

    def hold_replication(self) -> None:
        """The link stops forwarding (the connection stays open): the replica falls behind."""
        self.link.hold()

    async def stop_primary(self) -> None:
        """Stop the primary as a crash of its host would: no shutdown checkpoint, connections
        cut, and the WAL still on its way to the replica lost."""
        await self.primary.stop_immediately()
        await self.link.stop()

    async def promote(self) -> None:
        """Promote the replica; returns once it accepts writes."""
        await self.replica.pg_ctl("promote")

    async def close(self) -> None:
        """Stop both servers (immediately) and remove the folder; never raises."""
        with contextlib.suppress(Exception):
            await self.link.stop()
        await self.replica.close()
        await self.primary.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    async def _streaming(self, want: str) -> None:
        """Wait until the primary sees the replica streaming, as an ``want`` standby."""
        deadline = time.monotonic() + START_TIMEOUT
        conn = await asyncpg.connect(self.primary.url(), timeout=10)
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
