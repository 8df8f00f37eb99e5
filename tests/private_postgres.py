"""A PostgreSQL server of the tests' own: the one home for "a private cluster".

Tests that crash, stop, promote or reconfigure a server use one of these, never the shared
server on 127.0.0.1:5432 that every other test (and every other session on the machine) is
using. A ``PrivatePostgres`` runs the installed PostgreSQL's programs on a free loopback port,
with its data in a temporary folder that ``close()`` removes, whatever happened before.

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
from pathlib import Path

import asyncpg
import pytest

from tests.services import free_port, in_ci

__all__ = [
    "LOGICAL_DECODING",
    "PG_PROGRAMS",
    "PG_USER",
    "PrivatePostgres",
    "initdb",
    "postgres_bin",
    "require_postgres_programs",
    "run_as_server_user",
]

PG_PROGRAMS = ("initdb", "pg_ctl", "pg_basebackup")
PG_USER = "postgres"
COMMAND_TIMEOUT = 60

# Every private server's settings. fsync off: the tests crash the server process, never the
# machine, so what a commit wrote is in the page cache either way, and a shared test machine
# is spared the flushes. Small memory: several sessions may each run one.
SERVER_CONF = """
listen_addresses = '127.0.0.1'
port = {port}
unix_socket_directories = '{sockets}'
fsync = off
full_page_writes = off
shared_buffers = 16MB
max_connections = 100
"""

LOGICAL_DECODING = """
wal_level = logical
max_replication_slots = 8
max_wal_senders = 8
"""
"""Settings of a server whose log a relay follows (``wakeup: log``)."""


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
        "a PostgreSQL server of the test's own needs PostgreSQL's server programs "
        f"({', '.join(PG_PROGRAMS)}) and, as root, a '{PG_USER}' user: "
        "apt-get install postgresql"
    )
    if in_ci():
        pytest.fail(message)
    pytest.skip(message)


async def run_as_server_user(*command: str) -> None:
    """Run a PostgreSQL program as the server's user; raises with its stderr on failure."""
    as_user = ["runuser", "-u", PG_USER, "--"] if os.geteuid() == 0 else []
    result = await asyncio.to_thread(
        subprocess.run,
        [*as_user, *command],
        capture_output=True,
        text=True,
        check=False,
        timeout=COMMAND_TIMEOUT,
    )
    if result.returncode != 0:
        name = Path(command[0]).name
        raise RuntimeError(f"{name} failed ({result.returncode}): {result.stderr.strip()}")


async def initdb(folder: Path, bin_folder: Path) -> None:
    """A fresh cluster in ``folder`` (trust authentication, no fsync of its files)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    give_to_server_user(folder.parent)
    await run_as_server_user(
        str(bin_folder / "initdb"), "-N", "-A", "trust", "-U", PG_USER, "-D", str(folder)
    )


def give_to_server_user(path: Path) -> None:
    """Make the server's user own ``path`` (as root; anyone else already runs as it)."""
    if os.geteuid() == 0:
        user = pwd.getpwnam(PG_USER)
        os.chown(path, user.pw_uid, user.pw_gid)


def append(path: Path, text: str) -> None:
    """Append to one of the server's files."""
    # Written as root into the postgres user's file: appending keeps its owner and mode.
    with path.open("a") as file:
        file.write(text)


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


class PrivatePostgres:
    """One server: ``data`` (a cluster) in ``folder``, listening on 127.0.0.1:``port``."""

    def __init__(self, bin_folder: Path, folder: Path | None = None, name: str = "data") -> None:
        self.bin = bin_folder
        self.owns_folder = folder is None
        # Not pytest's tmp_path: its folders are 0700 root's, which the server's user cannot
        # enter. A short path also keeps the socket's under the 107 bytes a socket may have.
        self.folder = folder or Path(tempfile.mkdtemp(prefix="router-pg-"))
        give_to_server_user(self.folder)
        self.data = self.folder / name
        self.log = self.folder / f"{name}.log"
        self.port = free_port()

    def url(self, database: str = "postgres") -> str:
        """postgresql://postgres@127.0.0.1:<port>/<database>."""
        return f"postgresql://{PG_USER}@127.0.0.1:{self.port}/{database}"

    @property
    def running(self) -> bool:
        """Whether its postmaster is (or was, before a crash) running."""
        return (self.data / "postmaster.pid").exists()

    async def create(self, template: Path | None = None, settings: str = "") -> None:
        """initdb (or copy ``template``, a fresh initdb's folder), then its settings."""
        if template is not None:
            await run_as_server_user("cp", "-a", str(template), str(self.data))
        else:
            await initdb(self.data, self.bin)
        conf = SERVER_CONF.format(port=self.port, sockets=self.folder) + settings
        append(self.data / "postgresql.conf", conf)

    async def start(self) -> None:
        """Start it; returns once it accepts connections."""
        await self.pg_ctl("start")

    async def crash(self) -> None:
        """Stop it as a crash would (no shutdown checkpoint, WAL buffers lost, every
        connection cut) and start it again; returns once crash recovery is done."""
        await self.pg_ctl("restart", "-m", "immediate")

    async def stop_immediately(self) -> None:
        """Stop it as a crash would, and leave it stopped."""
        await self.pg_ctl("stop", "-m", "immediate")

    async def execute(self, *statements: str, database: str = "postgres") -> None:
        """Run statements, each in its own transaction, as the superuser."""
        conn = await asyncpg.connect(self.url(database), timeout=10)
        try:
            for statement in statements:
                await conn.execute(statement)
        finally:
            await conn.close()

    async def close(self) -> None:
        """Stop it (immediately) and remove its files; never raises."""
        if self.running:
            with contextlib.suppress(Exception):
                await self.stop_immediately()
        if self.owns_folder:
            shutil.rmtree(self.folder, ignore_errors=True)
        else:
            shutil.rmtree(self.data, ignore_errors=True)

    async def pg_ctl(self, action: str, *options: str) -> None:
        """``pg_ctl ACTION`` on its data, waiting for the action to finish."""
        await run_as_server_user(
            str(self.bin / "pg_ctl"),
            *("-D", str(self.data), "-l", str(self.log), "-w", *options, action),
        )
