"""The in-process fast path: when the application and ``router serve``'s processors share a
process, freshly committed rows are announced to their processors directly after COMMIT,
without waiting for PostgreSQL's NOTIFY round trip or SQLite's file watcher. The database
stays the source of truth: an announcement only wakes a processor early, and NOTIFY, the
watcher and the poll still cover everything.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from router._db import asyncpg_dsn, sqlite_path
from router.config import DatabaseSettings

__all__ = ["announce", "database_key", "listening", "register"]

Listener = Callable[[set[str]], None]

_lock = threading.Lock()
_listeners: dict[str, list[Listener]] = {}


def database_key(database: DatabaseSettings, base_dir: Path) -> str:
    """What identifies one database across configs loaded apart (path, or host/port/name)."""
    if database.kind == "sqlite":
        return f"sqlite:{sqlite_path(database, base_dir)}"
    from urllib.parse import urlsplit

    hosts = ",".join(f"{host}:{port}" for host, port in database.hosts())
    return f"postgresql:{hosts}{urlsplit(asyncpg_dsn(database)).path}"


def register(key: str, listener: Listener) -> Callable[[], None]:
    """Call ``listener`` with the targets of rows committed in this process; returns the
    function that stops it."""
    with _lock:
        _listeners.setdefault(key, []).append(listener)

    def unregister() -> None:
        with _lock:
            found = _listeners.get(key, [])
            if listener in found:
                found.remove(listener)

    return unregister


def listening(key: str) -> bool:
    """True when a processor of this database runs in this process."""
    return bool(_listeners.get(key))


def announce(key: str, targets: set[str]) -> None:
    """Rows for ``targets`` were just committed in this database."""
    for listener in list(_listeners.get(key, ())):
        listener(targets)
