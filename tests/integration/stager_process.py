"""A writer in a process of its own, for tests of wake-ups: ``python -m
tests.integration.stager_process URL``. Each line it reads stages one ``OrderPlaced`` with
``SyncOutbox.stage`` on a psycopg 3 connection and commits; it answers with the event's id and
the wall-clock time the commit returned. ``plain`` stages as stage() does; ``silent`` stages
the same statement with its ``pg_notify()`` swapped for a call that sends nothing, so only the
database's log can tell a relay of it. Another process, so no in-process signal of the
router's can wake the relay either.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from decimal import Decimal
from typing import Any

import psycopg

from router import SyncOutbox
from router.write import drivers
from tests.conftest import make_config
from tests.integration.events import OrderPlaced

NOTIFY = "pg_notify('router_outbox', "
SILENT = "concat('router_outbox', "  # same arguments, a text result, nothing sent


def main(url: str) -> None:
    outbox = SyncOutbox(
        make_config({"main": url}, {"events": {"type": "memory", "internal": True}})
    )
    execute = drivers._psycopg_execute
    silent = False

    def without_notify(connection: Any, statement: Any) -> None:
        if silent:
            assert NOTIFY in statement.sql, statement.sql  # the statement stage() sends
            statement = dataclasses.replace(statement, sql=statement.sql.replace(NOTIFY, SILENT))
        execute(connection, statement)

    drivers._psycopg_execute = without_notify
    with psycopg.connect(url) as conn:
        for number, line in enumerate(sys.stdin):
            silent = line.strip() == "silent"
            with conn.transaction():
                [message_id] = outbox.stage(
                    conn, OrderPlaced(order_id=f"o-{number}", total=Decimal(1))
                )
            print(message_id, time.time(), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
