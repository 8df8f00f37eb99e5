"""A private MariaDB with the binlog on (ROW format), for the wake-up tests that read it.

The shared server (127.0.0.1:3306) has the binlog off and is never reconfigured: this one is
installed in a temp folder owned by the ``mysql`` user, started as that user on a free port
(about 5 s), and stopped by its pid when the session ends. ``mariadb_binlog`` in
tests/conftest.py hands it out, once per session and only to a test that asks for it.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pymysql

from tests.services import free_port, program, require_programs

__all__ = ["PROGRAMS", "BinlogServer", "binlog_options"]

PROGRAMS = ("mariadbd", "mariadb-install-db")
START_TIMEOUT = 60.0
SERVER_ID = 1  # the server's own; the router's follower takes a random one far above it
# Small and quick: the tests write a few rows.
INNODB = (
    "--innodb-buffer-pool-size=32M",
    "--innodb-log-file-size=16M",
    "--innodb-log-buffer-size=4M",
)


def binlog_options(folder: Path) -> tuple[str, ...]:
    """What a ``mariadbd`` needs for a router to follow its binlog: the binlog on (its files
    in ``folder``), row events (the follower reads each row's target), and a server id of its
    own (a replica, which the follower is, must not share it)."""
    return (f"--log-bin={folder / 'binlog'}", "--binlog-format=ROW", f"--server-id={SERVER_ID}")


class BinlogServer:
    """``mariadbd`` with ``--log-bin --binlog-format=ROW`` in a folder of its own."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="router-binlog-"))
        self.datadir = self.folder / "data"
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> tuple[str, int]:
        """Where it listens."""
        return ("127.0.0.1", self.port)

    def url(self, database: str, user: str = "root", password: str = "") -> str:
        """A ``mysql://`` URL of one of its databases."""
        secret = f":{password}" if password else ""
        return f"mysql://{user}{secret}@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        """Install the system tables and start the server; returns once it answers."""
        require_programs("MariaDB", *PROGRAMS)
        shutil.chown(self.folder, "mysql", "mysql")
        self._run(
            str(program("mariadb-install-db")),
            "--no-defaults",
            "--user=mysql",
            f"--datadir={self.datadir}",
            "--auth-root-authentication-method=normal",
            "--skip-test-db",
            *INNODB,
        )
        log = (self.folder / "mariadbd.log").open("ab")
        self.process = subprocess.Popen(
            [
                str(program("mariadbd")),
                "--no-defaults",
                "--user=mysql",
                f"--datadir={self.datadir}",
                f"--socket={self._socket()}",
                f"--port={self.port}",
                "--bind-address=127.0.0.1",
                *binlog_options(self.folder),
                f"--pid-file={self.folder / 'pid'}",
                f"--log-error={self.folder / 'mariadbd.log'}",
                "--skip-name-resolve",
                "--performance-schema=OFF",
                *INNODB,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C reaches pytest, which stops it
        )
        log.close()
        self._wait_answering()

    def execute(self, statement: str, database: str | None = None) -> list[tuple[object, ...]]:
        """One statement as root on a connection of its own; its rows."""
        conn = pymysql.connect(
            host="127.0.0.1", port=self.port, user="root", database=database, autocommit=True
        )
        try:
            with conn.cursor() as cursor:
                cursor.execute(statement)
                return list(cursor.fetchall())
        finally:
            conn.close()

    def stop(self) -> None:
        """SIGTERM by pid (a kill after 30 s), then remove its folder."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _socket(self) -> str:
        path = self.folder / "sock"  # sun_path holds 108 bytes
        return str(path) if len(str(path)) < 100 else f"/tmp/router-{uuid.uuid4().hex[:12]}.sock"

    def _run(self, *command: str) -> None:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{command[0]} failed: {result.stdout}{result.stderr}")

    def _wait_answering(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mariadbd exited at start: {self._log_tail()}")
            with contextlib.suppress(pymysql.MySQLError):
                self.execute("SELECT 1")
                return
            time.sleep(0.1)
        raise RuntimeError(f"mariadbd did not answer in {START_TIMEOUT:.0f} s: {self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            text = (self.folder / "mariadbd.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-15:])
