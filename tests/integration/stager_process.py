"""Stage events from a process of its own, as an application beside ``router serve`` does.

    python -m tests.integration.stager_process CONFIG PLAN

``CONFIG``: a config file; ``PLAN``: JSON ``{"threads": [[s, s, ...], ...]}``, per thread the
seconds to sleep before each of its events. Each event is one transaction of its own on a
connection of the thread's (psycopg 3 on PostgreSQL, PyMySQL on MariaDB, sqlite3 on SQLite),
on the stream key ``t<thread>``. Prints one JSON line per commit, right after it returns:
``{"id": message id, "committed": epoch seconds}``.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from decimal import Decimal
from typing import Any

from router import SyncOutbox
from router._db import sqlite_path
from tests.integration.events import OrderPlaced

_print = threading.Lock()


def connect(outbox: SyncOutbox) -> Any:
    """A DB-API connection to the outbox's one database, as an application would open one."""
    settings = next(iter(outbox.config.databases.values()))
    url = settings.url.get_secret_value()
    if url.startswith("postgresql"):
        import psycopg

        return psycopg.connect(url)
    if url.startswith("mysql"):
        import pymysql

        rest = url.split("://", 1)[1]
        user, _, hostpart = rest.partition("@")
        host, _, name = hostpart.partition("/")
        server, _, port = host.partition(":")
        return pymysql.connect(host=server, port=int(port or 3306), user=user, database=name)
    import sqlite3

    return sqlite3.connect(sqlite_path(settings, outbox.config.base_dir))


def run_thread(outbox: SyncOutbox, number: int, sleeps: list[float]) -> None:
    """Stage one event after each sleep, each in its own transaction."""
    conn = connect(outbox)
    try:
        for n, pause in enumerate(sleeps):
            time.sleep(pause)
            [message_id] = outbox.stage(
                conn,
                OrderPlaced(order_id=f"{number}-{n}", total=Decimal(n)),
                stream_key=f"t{number}",
            )
            conn.commit()
            committed = time.time()
            with _print:
                print(json.dumps({"id": message_id, "committed": committed}), flush=True)
    finally:
        conn.close()


def main(config: str, plan: str) -> None:
    """Run every thread of ``plan`` at once."""
    outbox = SyncOutbox.from_file(config)
    threads = [
        threading.Thread(target=run_thread, args=(outbox, number, sleeps))
        for number, sleeps in enumerate(json.loads(plan)["threads"])
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
