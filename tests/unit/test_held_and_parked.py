"""``ordering: hold`` and ``ordering: park`` over the in-memory broker and a real SQLite outbox:
a stream's head refused for good (or out of attempts) is kept, held or parked, instead of
abandoned; the later rows of its stream wait, untried, other streams flow, and no gap is
recorded. Parked rows take the rest of their stream with them, rows staged later too."""

from __future__ import annotations

import asyncio
import sqlite3
from typing import Any

import pytest

from brokers import PublishResult
from tests.unit.conftest import (
    EVENTS_BROKER,
    OpenOutbox,
    OutboxFile,
    number_of,
    numbers,
    refusing,
)

KEPT = {"hold": "held", "park": "parked"}
"""The status of a head each ordering keeps."""
BEHIND = {"hold": "pending", "park": "parked"}
"""The status of the rows after it: waiting untried, or parked with it."""


async def kept(open_outbox: OpenOutbox, ordering: str, **outbox: Any) -> OutboxFile:
    """An outbox whose broker ``events`` keeps stream heads as ``ordering`` says."""
    return await open_outbox(brokers={"events": {**EVENTS_BROKER, "ordering": ordering}}, **outbox)


def gaps(outbox_file: OutboxFile) -> list[Any]:
    with sqlite3.connect(outbox_file.path) as db:
        return list(db.execute("SELECT * FROM router_gaps"))


@pytest.mark.parametrize("ordering", ["hold", "park"])
async def test_a_head_refused_for_good_holds_its_stream_and_the_others_flow(
    open_outbox: OpenOutbox, ordering: str
) -> None:
    outbox_file = await kept(open_outbox, ordering)
    outbox_file.broker.handler = refusing(2, retryable=False)
    await outbox_file.stage(1, 2, 3, stream_key="k")
    await outbox_file.stage(4, stream_key="other")
    processor = outbox_file.processor()

    await processor.drain()
    await outbox_file.stage(5, stream_key="k")  # staged while the stream is kept
    await outbox_file.stage(6, stream_key="other")
    await processor.drain()

    assert numbers(outbox_file.broker) == [1, 4, 6]
    assert sorted(number_of(m) for m in outbox_file.broker.attempts) == [1, 2, 4, 6]  # not 3, 5
    rows = outbox_file.rows()
    status, behind = KEPT[ordering], BEHIND[ordering]  # parked: 5 too, as it came
    assert [(r["status"], r["attempts"]) for r in rows] == [
        ("published", 1),
        (status, 1),
        (behind, 0),
        ("published", 1),
        (behind, 0),
        ("published", 1),
    ]
    assert rows[1]["last_error"] == "not retryable: refused 2"
    assert gaps(outbox_file) == []  # nothing was skipped


@pytest.mark.parametrize("ordering", ["hold", "park"])
async def test_a_head_out_of_attempts_is_kept_too(open_outbox: OpenOutbox, ordering: str) -> None:
    retry = {"base_delay": 0.01, "max_delay": 0.01, "jitter": 0, "max_attempts": 2}
    outbox_file = await kept(open_outbox, ordering, retry=retry)
    outbox_file.broker.handler = refusing(1)
    await outbox_file.stage(1, 2, stream_key="k")
    processor = outbox_file.processor()

    for _ in range(50):
        await processor.drain()
        if outbox_file.statuses()[0] != "failed":
            break
        await asyncio.sleep(0.02)

    first, second = outbox_file.rows()
    assert (first["status"], first["attempts"]) == (KEPT[ordering], 2)
    assert first["last_error"] == "gave up after 2 attempts: refused 1"
    assert second["status"] == BEHIND[ordering]
    assert outbox_file.broker.messages == []


@pytest.mark.parametrize("ordering", ["hold", "park"])
async def test_a_row_without_a_stream_key_is_abandoned_whatever_the_ordering(
    open_outbox: OpenOutbox, ordering: str
) -> None:
    outbox_file = await kept(open_outbox, ordering)
    outbox_file.broker.handler = refusing(1, retryable=False)
    await outbox_file.stage(1, 2)

    await outbox_file.processor().drain()

    assert outbox_file.statuses() == ["abandoned", "published"]


@pytest.mark.parametrize("ordering", ["hold", "park"])
async def test_a_broker_that_cannot_be_reached_keeps_nothing_and_costs_no_attempt(
    open_outbox: OpenOutbox, ordering: str
) -> None:
    outbox_file = await kept(open_outbox, ordering)
    outbox_file.broker.handler = lambda message: PublishResult.cut_off("connection lost")
    await outbox_file.stage(1, 2, stream_key="k")

    await outbox_file.processor().drain()

    assert [(r["status"], r["attempts"]) for r in outbox_file.rows()] == [("pending", 0)] * 2
