"""MariaDB: stage() locks a stream key's slot row of ``router_streams`` in the INSERT itself
(router/write/mysql.py): one statement per call, a table that never grows, a missing slot
row put back, and the caller's order kept under one lock."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy
from sqlalchemy import event

from router import SyncOutbox
from router.write.mysql import STREAM_SLOTS, slot_of
from tests.conftest import MEMORY_BROKERS, make_config, mysql_fetch
from tests.integration.events import OrderPlaced, StockReserved


@pytest.fixture
def engine(mysql_url: str) -> Iterator[sqlalchemy.Engine]:
    made = sqlalchemy.create_engine(mysql_url.replace("mysql://", "mysql+pymysql://", 1))
    yield made
    made.dispose()


@pytest.fixture
def outbox(mysql_url: str) -> SyncOutbox:
    return SyncOutbox(make_config({"main": mysql_url}, MEMORY_BROKERS))


def statements_run(engine: sqlalchemy.Engine) -> list[str]:
    """Every statement the engine runs from now on."""
    seen: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda *args: seen.append(args[2]))
    return seen


def stored(url: str) -> list[dict[str, Any]]:
    return asyncio.run(
        mysql_fetch(url, "SELECT target, stream_key, envelope FROM router_outbox ORDER BY seq")
    )


def order_id(row: dict[str, Any]) -> str:
    return str(json.loads(row["envelope"])["payload"]["order_id"])


def test_one_key_locks_and_inserts_in_one_statement_and_the_table_keeps_its_slots(
    mysql_url: str, engine: sqlalchemy.Engine, outbox: SyncOutbox
) -> None:
    seen = statements_run(engine)
    with engine.connect() as conn:
        for i in range(300):
            with conn.begin():
                outbox.stage(
                    conn, StockReserved(order_id=f"o-{i}", quantity=i), stream_key=f"o-{i}"
                )
    inserts = [s for s in seen if "router_outbox" in s or "router_streams" in s]
    assert len(inserts) == 300
    assert all(s.startswith("INSERT INTO router_outbox") and "FOR UPDATE" in s for s in inserts)
    assert len(stored(mysql_url)) == 300
    slots = asyncio.run(mysql_fetch(mysql_url, "SELECT stream_key FROM router_streams"))
    assert sorted(int(row["stream_key"]) for row in slots) == list(range(STREAM_SLOTS))


def test_a_missing_slot_row_is_put_back_and_nothing_is_lost(
    mysql_url: str, engine: sqlalchemy.Engine, outbox: SyncOutbox
) -> None:
    slot = slot_of("o-1")
    asyncio.run(mysql_fetch(mysql_url, "DELETE FROM router_streams WHERE stream_key = %s", slot))
    with engine.begin() as conn:
        outbox.stage(conn, StockReserved(order_id="o-1", quantity=1), stream_key="o-1")
    assert [row["stream_key"] for row in stored(mysql_url)] == ["o-1"]
    back = asyncio.run(
        mysql_fetch(mysql_url, "SELECT 1 FROM router_streams WHERE stream_key = %s", slot)
    )
    assert back == [{"1": 1}]


def test_a_second_writer_on_a_key_whose_slot_row_was_missing_still_waits(
    mysql_url: str, engine: sqlalchemy.Engine, outbox: SyncOutbox
) -> None:
    asyncio.run(mysql_fetch(mysql_url, "TRUNCATE TABLE router_streams"))
    order: list[str] = []
    with engine.connect() as first:
        with first.begin():
            outbox.stage(first, StockReserved(order_id="first", quantity=1), stream_key="k")

            def second() -> None:
                with engine.begin() as conn:
                    outbox.stage(conn, StockReserved(order_id="second", quantity=2), stream_key="k")
                order.append("second committed")

            later = threading.Thread(target=second)
            later.start()
            time.sleep(0.3)
            assert order == []  # waiting on the slot row the first transaction put back
            order.append("first commits")
        later.join(5)
    assert order == ["first commits", "second committed"]
    assert [order_id(row) for row in stored(mysql_url)] == ["first", "second"]


def test_many_rows_under_one_key_go_in_one_statement_in_the_callers_order(
    mysql_url: str, engine: sqlalchemy.Engine, outbox: SyncOutbox
) -> None:
    events = [OrderPlaced(order_id=f"o-{i}", total=Decimal(i)) for i in range(5)]
    seen = statements_run(engine)
    with engine.begin() as conn:
        outbox.stage(conn, *events, stream_key="customer-7")
    assert len([s for s in seen if "router_outbox" in s or "router_streams" in s]) == 1
    rows = stored(mysql_url)
    # One row per target of each event, event by event: seq follows the order given.
    expected = [(f"o-{i}", t) for i in range(5) for t in ("events", "analytics", "billing")]
    assert [(order_id(row), row["target"]) for row in rows] == expected
