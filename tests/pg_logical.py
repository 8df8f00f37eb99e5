"""A private PostgreSQL cluster with ``wal_level = logical``, for the log wake-up's tests.

The shared server on 5432 runs ``wal_level = replica`` and must never be reconfigured or
restarted, so a test that reads the log gets a cluster of its own on a free port, made with
Debian's cluster tools (``pg_createcluster``, run as root: the cluster's files belong to the
``postgres`` user), trust authentication for normal and replication connections on loopback,
and dropped at the end of the session whatever happened (``pg_dropcluster --stop``). It is
made only when a test asks for it (about 3 s). Under ``CI=true`` failing to make it fails the
test; elsewhere it skips, with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.services import free_port, in_ci

__all__ = ["LogicalCluster", "make_cluster"]

VERSION = "15"
"""The column list of the wake-up's publication needs PostgreSQL 15."""

SETTINGS = {
    "wal_level": "logical",
    "max_replication_slots": "8",
    "max_wal_senders": "8",
    # The tests stop the server, never the machine: no flush to wait for on a shared host.
    "fsync": "off",
    "shared_buffers": "16MB",
    "max_connections": "50",
}
TOOLS = ("pg_createcluster", "pg_ctlcluster", "pg_dropcluster")


@dataclass
class LogicalCluster:
    """A running cluster: its name and port; ``drop()`` removes it."""

    name: str
    port: int

    def url(self, database: str = "postgres") -> str:
        """A URL of one of its databases, as the superuser ``postgres`` (trust)."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def drop(self) -> None:
        """Stop it and remove its files and configuration."""
        subprocess.run(
            ["pg_dropcluster", "--stop", VERSION, self.name], capture_output=True, check=False
        )


def make_cluster() -> LogicalCluster:
    """Create and start the cluster; fails (CI) or skips (elsewhere) when it cannot."""
    problem = _missing()
    if problem is None:
        cluster = LogicalCluster(f"router_log_{uuid.uuid4().hex[:8]}", free_port())
        try:
            _run("pg_createcluster", VERSION, cluster.name, "-p", str(cluster.port),
                 *_options(), "--", "--auth=trust")  # fmt: skip
            _run("pg_ctlcluster", "--skip-systemctl-redirect", VERSION, cluster.name, "start")
            return cluster
        except subprocess.CalledProcessError as exc:
            cluster.drop()
            problem = f"{' '.join(exc.cmd[:3])} failed: {(exc.stderr or '').strip()[-500:]}"
    message = f"a PostgreSQL cluster with wal_level=logical could not be made: {problem}"
    if in_ci():
        pytest.fail(message)
    pytest.skip(message)


def _missing() -> str | None:
    """Why no cluster can be made here (None: it can be tried)."""
    absent = [tool for tool in TOOLS if shutil.which(tool) is None]
    if absent:
        return f"{', '.join(absent)} not installed: apt-get install postgresql-common"
    if not Path(f"/usr/lib/postgresql/{VERSION}/bin/initdb").exists():
        return (
            f"PostgreSQL {VERSION}'s server is not installed: apt-get install postgresql-{VERSION}"
        )
    if os.geteuid() != 0:
        return "pg_createcluster must run as root (the cluster belongs to the postgres user)"
    return None


def _options() -> list[str]:
    return [arg for key, value in SETTINGS.items() for arg in ("-o", f"{key}={value}")]


def _run(*command: str) -> None:
    subprocess.run(command, capture_output=True, text=True, check=True, timeout=60)
