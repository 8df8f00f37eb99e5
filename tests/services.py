"""Reaching the real services the tests use, and what to do when one is missing.

Under ``CI=true`` a missing service fails the test (a skip would count as a pass); on a
developer's machine it skips with the reason and the command that starts the service. Run
through ``scripts/test`` or ``scripts/fast`` (which set ``NO_SKIPS``), any skip fails the
run, CI or not: tests/conftest.py turns it into a failure.
"""

from __future__ import annotations

import os
import shutil
import socket

import pytest

POSTGRES = ("127.0.0.1", 5432)
NATS = ("127.0.0.1", 4222)
MARIADB = ("127.0.0.1", 3306)

START = {
    "PostgreSQL": "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start",
    "NATS": (
        "start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- "
        "-a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log"
    ),
    # /etc/mysql/my.cnf has the rest: user mysql, 127.0.0.1:3306, /var/lib/mysql.
    "MariaDB": (
        "install -d -o mysql -g mysql /run/mysqld && "
        "start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd"
    ),
}


# Services a test starts itself, from the programs of these packages.
INSTALL = {"MariaDB": "apt-get install mariadb-server (mariadbd, mariadb-install-db)"}


# Set to "1" by scripts/test and scripts/fast: there a skipped test is a failure, since the
# summary line of a run by hand would otherwise read as a pass with ~230 tests not run.
NO_SKIPS = "ROUTER_TESTS_NO_SKIPS"


def skips_fail() -> bool:
    """True where a skip must fail the run: under CI, and under scripts/test or scripts/fast."""
    return in_ci() or os.environ.get(NO_SKIPS) == "1"


def in_ci() -> bool:
    """True when running under CI, where nothing may be skipped for a missing service."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def reachable(host: str, port: int, timeout: float = 1.0) -> bool:
    """True when something accepts TCP connections at host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def require(service: str, address: tuple[str, int]) -> None:
    """Fail (CI) or skip (laptop) unless ``service`` answers at ``address``."""
    if reachable(*address):
        return
    message = (
        f"{service} is not reachable at {address[0]}:{address[1]}; start it with: {START[service]}"
    )
    if in_ci():
        pytest.fail(message)
    pytest.skip(message)


def program(name: str) -> str | None:
    """The path of an installed program, sbin folders included (mariadbd lives in /usr/sbin)."""
    folders = [os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"]
    return shutil.which(name, path=os.pathsep.join(folders))


def require_programs(service: str, *names: str) -> None:
    """Fail (CI) or skip (laptop) unless every program of ``service`` is installed."""
    missing = [name for name in names if program(name) is None]
    if not missing:
        return
    message = f"{service}: {', '.join(missing)} not installed; install it with: {INSTALL[service]}"
    if in_ci():
        pytest.fail(message)
    pytest.skip(message)


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


RABBITMQ = ("127.0.0.1", 5672)
REDIS = ("127.0.0.1", 6379)
START["RabbitMQ"] = "rabbitmq-server -detached"
START["Redis"] = (
    'redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" '
    "--appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log"
)
