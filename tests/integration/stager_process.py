"""A writer in a process of its own, for the wake-up tests: an application beside
``router serve``, so no in-process signal of the router's can wake the relay.

    python -m tests.integration.stager_process TARGET [PLAN]

``TARGET``: a config file, or a database URL (then one internal memory broker, ``events``).
Each event is ``SyncOutbox.stage`` of one ``OrderPlaced`` in a transaction of its own, on a
connection of the writer's (psycopg 3 on PostgreSQL, SQLAlchemy and PyMySQL on MariaDB,
sqlite3 on SQLite),
opened before the first: a commit costs what an application's does. After each COMMIT
returns it prints ``{"id": message id, "committed": epoch seconds}``.

Without ``PLAN``, it stages one event per line it reads (after printing ``ready``). ``PLAN``:
JSON ``{"threads": [[s, s, ...], ...]}``, per thread (each on its own connection and stream
key ``t<n>``) the seconds to sleep before each of its events; then it exits.
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
from tests.conftest import make_config
from tests.integration.events import OrderPlaced

_print = threading.Lock()


def outbox_for(target: str) -> SyncOutbox:
    """The writer's outbox: from a config file, or on a bare URL."""
    if "://" not in target:
        return SyncOutbox.from_file(target)
    return SyncOutbox(
        make_config({"main": target}, {"events": {"type": "memory", "internal": True}})
    )


def connect(outbox: SyncOutbox) -> Any:
    """A DB-API connection to the outbox's one database, as an application would open one."""
    settings = next(iter(outbox.config.databases.values()))
    url = settings.url.get_secret_value()
    if settings.kind == "postgresql":
        import psycopg

        return psycopg.connect(url)
    if settings.kind == "mysql":  # a raw PyMySQL connection is not one stage() takes
        import sqlalchemy as sa

        engine = sa.create_engine(url.replace("mysql://", "mysql+pymysql://", 1))
        return engine.connect()
    import sqlite3

    return sqlite3.connect(sqlite_path(settings, outbox.config.base_dir))


class Writer:
    """One connection, staging one event per ``stage()``."""

    def __init__(self, outbox: SyncOutbox, number: int) -> None:
        self.outbox = outbox
        self.number = number
        self.count = 0
        self.conn = connect(outbox)

    def stage(self) -> None:
        """Commit one event; print its id and when the commit returned."""
        event = OrderPlaced(order_id=f"{self.number}-{self.count}", total=Decimal(self.count))
        self.count += 1
        [message_id] = self.outbox.stage(self.conn, event, stream_key=f"t{self.number}")
        self.conn.commit()
        committed = time.time()
        with _print:
            print(json.dumps({"id": message_id, "committed": committed}), flush=True)


def run_plan(outbox: SyncOutbox, plan: dict[str, Any]) -> None:
    """Every thread of ``plan`` at once."""

    def run(number: int, sleeps: list[float]) -> None:
        writer = Writer(outbox, number)
        try:
            for pause in sleeps:
                time.sleep(pause)
                writer.stage()
        finally:
            writer.conn.close()

    threads = [
        threading.Thread(target=run, args=(number, sleeps))
        for number, sleeps in enumerate(plan["threads"])
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def run_lines(outbox: SyncOutbox) -> None:
    """One event per line read."""
    writer = Writer(outbox, 0)
    print("ready", flush=True)
    for _ in sys.stdin:
        writer.stage()


if __name__ == "__main__":
    writes = outbox_for(sys.argv[1])
    if len(sys.argv) > 2:
        run_plan(writes, json.loads(sys.argv[2]))
    else:
        run_lines(writes)
