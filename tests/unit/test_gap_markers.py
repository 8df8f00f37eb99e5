"""Gap markers over the in-memory broker and a real SQLite outbox: the message delivered
after an abandoned row of its stream names it (``skipped-message-ids``, and ``skipped`` in
the internal envelope), once; and what a run of batches carries from one batch to the next
(``RunStreams``)."""

from __future__ import annotations

import sqlite3

import orjson

from brokers import OutgoingMessage
from router.relay.streams import RunStreams
from tests.unit.conftest import OpenOutbox, OutboxFile, number_of, refusing

HEADER = "skipped-message-ids"


def by_number(outbox_file: OutboxFile) -> dict[int, OutgoingMessage]:
    return {number_of(m): m for m in outbox_file.broker.messages}


def skipped_in_body(message: OutgoingMessage) -> list[str] | None:
    document = orjson.loads(message.wire.body)
    found: list[str] | None = document.get("skipped")
    return found


def gap_rows(outbox_file: OutboxFile) -> list[tuple[str, str, str]]:
    with sqlite3.connect(outbox_file.path) as db:
        query = "SELECT target, stream_key, message_id FROM router_gaps ORDER BY seq"
        return [tuple(row) for row in db.execute(query)]


async def test_the_next_row_of_the_stream_in_the_same_batch_names_the_abandoned_one(
    outbox_file: OutboxFile,
) -> None:
    outbox_file.broker.handler = refusing(2, retryable=False)
    ids = await outbox_file.stage(1, 2, 3, stream_key="k")
    await outbox_file.stage(4, stream_key="other")

    await outbox_file.processor().drain()

    sent = by_number(outbox_file)
    assert sorted(sent) == [1, 3, 4]
    assert sent[3].wire.headers[HEADER] == ids[1]
    assert skipped_in_body(sent[3]) == [ids[1]]
    for n in (1, 4):
        assert HEADER not in sent[n].wire.headers
        assert skipped_in_body(sent[n]) is None
    assert outbox_file.statuses() == ["published", "abandoned", "published", "published"]
    assert gap_rows(outbox_file) == []  # named by 3, in the mark that recorded it


async def test_a_gap_waits_for_the_next_row_of_its_stream_and_is_named_once(
    open_outbox: OpenOutbox,
) -> None:
    # Out of attempts (one) is a gap as much as a refusal for good.
    outbox_file = await open_outbox(retry={"max_attempts": 1, "base_delay": 0.01})
    outbox_file.broker.handler = refusing(2, 3)
    ids = await outbox_file.stage(1, 2, 3, stream_key="k")
    processor = outbox_file.processor()
    await processor.drain()
    assert [number_of(m) for m in outbox_file.broker.messages] == [1]
    assert [gap[2] for gap in gap_rows(outbox_file)] == ids[1:]

    await outbox_file.stage(5, stream_key="k")
    await outbox_file.stage(6, stream_key="other")
    await processor.drain()
    await outbox_file.stage(7, stream_key="k")
    await processor.drain()

    sent = by_number(outbox_file)
    assert sent[5].wire.headers[HEADER] == f"{ids[1]},{ids[2]}"  # oldest first
    assert skipped_in_body(sent[5]) == ids[1:]
    assert HEADER not in sent[6].wire.headers
    assert HEADER not in sent[7].wire.headers  # named once: 5 closed the gap
    assert gap_rows(outbox_file) == []


def test_a_run_names_what_its_earlier_batches_abandoned_and_not_what_they_named() -> None:
    streams = RunStreams()
    assert streams.skipped("k", 10, ("a",)) == ("a",)  # nothing happened in the run
    streams.abandoned("k", 5, "b")
    streams.abandoned("k", 12, "late")  # after the row asking: not its gap
    streams.abandoned(None, 6, "no-stream")
    assert streams.skipped("k", 10, ("a",)) == ("a", "b")
    assert streams.skipped("k", 10, ("a", "b")) == ("a", "b")  # its claim read it already
    assert streams.skipped("other", 10, ()) == ()
    streams.published("k", ("a", "b"))  # a row published in the run named both
    assert streams.skipped("k", 11, ("a",)) == ()
    assert streams.skipped("k", 13, ()) == ("late",)
    assert streams.skipped(None, 13, ()) == ()
