"""One process of ``bench.stage_sync``'s from-process-start rounds: import what a sync script
imports, connect, commit one transaction staging one event (one target), print the wall clock
at each step as JSON, exit.

    python bench/_stage_sync_cold.py stage|hand URL CONFIG

``stage``: ``SyncOutbox.from_file(CONFIG)`` and ``stage()`` on a psycopg 3 connection, as
docs/frameworks.md shows it. ``hand``: the strongest hand-written alternative a script has:
psycopg and pydantic only, the event a pydantic model, one row of the outbox a team would
write (``bench._writers``' hand outbox: a uuid4, the target, the type, the key and the
event's JSON) by a plain ``INSERT``; no envelope, no stream-key lock, no NOTIFY, no checks.
Run as a file, not ``-m``: the ``bench`` package (and what it imports) is no part of either.
"""

from __future__ import annotations

import time

STARTED = time.time()

import json  # noqa: E402  (after the clock: the imports are what is measured)
import sys  # noqa: E402

INSERT = "INSERT INTO hand_outbox (id, target, type, key, payload) VALUES (%s, %s, %s, %s, %s)"


def staged(url: str, config: str, marks: dict[str, float]) -> None:
    """Through ``SyncOutbox.stage()``."""
    import psycopg

    from router import Event, SyncOutbox

    class OrderPlaced(Event, type="order_placed", published=True):
        order_id: str
        customer: str
        total: str
        lines: int

    outbox = SyncOutbox.from_file(config)
    marks["imported"] = time.time()
    with psycopg.connect(url) as conn:
        marks["connected"] = time.time()
        with conn.transaction():
            event = OrderPlaced(order_id="order-1", customer="customer-1", total="1.99", lines=2)
            outbox.stage(conn, event, stream_key="order-1")
        marks["committed"] = time.time()


def by_hand(url: str, marks: dict[str, float]) -> None:
    """The event, written by hand into the hand outbox."""
    import uuid

    import psycopg
    from pydantic import BaseModel

    class OrderPlaced(BaseModel):
        order_id: str
        customer: str
        total: str
        lines: int

    marks["imported"] = time.time()
    with psycopg.connect(url) as conn:
        marks["connected"] = time.time()
        with conn.transaction():
            event = OrderPlaced(order_id="order-1", customer="customer-1", total="1.99", lines=2)
            row = (uuid.uuid4(), "events", "order_placed", "order-1", event.model_dump_json())
            conn.execute(INSERT, row)
        marks["committed"] = time.time()


def main() -> None:
    """``stage`` or ``hand``, then the marks on stdout."""
    variant, url, config = sys.argv[1:4]
    marks = {"started": STARTED}
    if variant == "stage":
        staged(url, config, marks)
    else:
        by_hand(url, marks)
    print(json.dumps(marks))


if __name__ == "__main__":
    main()
