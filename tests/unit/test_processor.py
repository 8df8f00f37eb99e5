"""The processor over the in-memory broker and a real SQLite outbox: what arrives, what the
table says afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from brokers import OutgoingMessage, PublishResult
from envelopes import DatabaseError
from router.relay.processor import Processor
from router.relay.store import Marks
from tests.unit.conftest import (
    EVENTS_BROKER,
    OpenOutbox,
    OutboxFile,
    number_of,
    numbers,
    read_time,
    refusing,
)

MICROSECOND = timedelta(microseconds=1)


async def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll ``condition()`` until it holds; fail the test after ``timeout`` seconds."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def running(processor: Processor) -> AsyncIterator[None]:
    """``processor.run()`` as a task; on leaving, ``stop()``, which must end it within 2 s."""
    task = asyncio.create_task(processor.run())
    try:
        yield
        processor.stop()
        await asyncio.wait_for(task, 2)
    finally:
        task.cancel()


async def test_drain_publishes_every_row_in_seq_order_and_marks_it_published(
    outbox_file: OutboxFile,
) -> None:
    first = await outbox_file.stage(1, 2, 3)
    second = await outbox_file.stage(4, 5)
    processor = outbox_file.processor()

    assert await processor.drain() == 5

    assert numbers(outbox_file.broker) == [1, 2, 3, 4, 5]
    assert outbox_file.broker.ids() == first + second
    rows = outbox_file.rows()
    assert [r["message_id"] for r in rows] == first + second
    assert [r["status"] for r in rows] == ["published"] * 5
    assert all(r["published_at"] is not None for r in rows)
    assert all((r["attempts"], r["locked_by"], r["last_error"]) == (1, None, None) for r in rows)
    assert await processor.drain() == 0  # nothing is sent twice
    assert len(outbox_file.broker.attempts) == 5


@pytest.mark.parametrize(("rand", "delay"), [(0.0, 0.8), (0.5, 1.0), (1.0, 1.2)])
async def test_a_retryable_failure_waits_its_backoff_while_the_rest_is_published(
    outbox_file: OutboxFile, rand: float, delay: float
) -> None:
    """base_delay 1 s with 20 % jitter: the first retry is due 0.8 to 1.2 s later."""
    outbox_file.broker.handler = refusing(2)
    await outbox_file.stage(1, 2, 3)
    before = datetime.now(UTC)
    assert await outbox_file.processor(rand=rand).run_once() == 3
    after = datetime.now(UTC)

    rows = outbox_file.rows()
    assert [r["status"] for r in rows] == ["published", "failed", "published"]
    failed = rows[1]
    assert (failed["attempts"], failed["locked_by"]) == (1, None)
    assert failed["last_error"] == "refused 2"
    wait = timedelta(seconds=delay)
    due = read_time(failed["available_at"])
    assert before + wait - MICROSECOND <= due <= after + wait + MICROSECOND
    assert numbers(outbox_file.broker) == [1, 3]


async def test_a_failed_row_is_not_retried_early_and_is_published_once_due(
    open_outbox: OpenOutbox,
) -> None:
    outbox_file = await open_outbox(retry={"base_delay": 0.5, "max_delay": 1, "jitter": 0})
    outbox_file.broker.handler = refusing(1, times=1)
    await outbox_file.stage(1)
    processor = outbox_file.processor()

    assert await processor.drain() == 1
    assert await processor.drain() == 0  # not due yet
    assert outbox_file.statuses() == ["failed"]
    await asyncio.sleep(0.55)
    assert await processor.drain() == 1

    [row] = outbox_file.rows()
    assert (row["status"], row["attempts"], row["last_error"]) == ("published", 2, None)
    assert numbers(outbox_file.broker) == [1]


async def test_a_non_retryable_failure_abandons_the_row_at_once(outbox_file: OutboxFile) -> None:
    outbox_file.broker.handler = refusing(1, retryable=False)
    await outbox_file.stage(1, 2)
    processor = outbox_file.processor()

    await processor.drain()

    rows = outbox_file.rows()
    assert [(r["status"], r["attempts"]) for r in rows] == [("abandoned", 1), ("published", 1)]
    assert rows[0]["last_error"] == "not retryable: refused 1"
    assert await processor.drain() == 0
    assert len(outbox_file.broker.attempts) == 2  # the abandoned row was tried once


async def test_a_row_is_abandoned_after_max_attempts(open_outbox: OpenOutbox) -> None:
    outbox_file = await open_outbox(
        retry={"base_delay": 0.01, "max_delay": 0.01, "jitter": 0, "max_attempts": 3}
    )
    outbox_file.broker.handler = refusing(1)
    await outbox_file.stage(1)
    processor = outbox_file.processor()

    for _ in range(50):
        await processor.drain()
        if outbox_file.statuses() == ["abandoned"]:
            break
        await asyncio.sleep(0.02)

    [row] = outbox_file.rows()
    assert (row["status"], row["attempts"]) == ("abandoned", 3)
    assert row["last_error"] == "gave up after 3 attempts: refused 1"
    assert len(outbox_file.broker.attempts) == 3
    assert outbox_file.broker.messages == []


async def test_a_down_broker_costs_no_attempt_and_opens_the_circuit_until_it_is_back(
    open_outbox: OpenOutbox,
) -> None:
    outbox_file = await open_outbox(retry={"base_delay": 0.5, "max_delay": 1, "jitter": 0})
    outbox_file.broker.down = True
    await outbox_file.stage(1, 2, 3)
    processor = outbox_file.processor()

    assert await processor.drain() == 3  # claimed once, given back, then no claim
    rows = outbox_file.rows()
    assert [(r["status"], r["attempts"]) for r in rows] == [("pending", 0)] * 3
    assert processor.circuit.is_open
    assert processor.circuit.reason == "events: broker is down"
    assert outbox_file.broker.messages == []

    outbox_file.broker.down = False
    await asyncio.sleep(0.3)  # the first probe is due after a quarter of a second
    assert await processor.drain() == 3
    assert outbox_file.statuses() == ["published"] * 3
    assert numbers(outbox_file.broker) == [1, 2, 3]
    assert not processor.circuit.is_open


async def test_a_circuit_opened_by_the_last_batch_is_probed_without_a_wake_up(
    outbox_file: OutboxFile,
) -> None:
    """The broker goes away under the last batch staged: nothing wakes the processor again
    (the poll interval is 60 s), yet it probes on schedule and delivers once the broker is
    back."""
    outbox_file.broker.down = True
    await outbox_file.stage(1, 2)
    processor = outbox_file.processor()
    task = asyncio.create_task(processor.run())
    try:
        processor.wake()
        await wait_until(lambda: processor.circuit.is_open)
        outbox_file.broker.down = False
        await outbox_file.broker.wait_for(2, timeout=3)
        assert numbers(outbox_file.broker) == [1, 2]
        processor.stop()
        await asyncio.wait_for(task, 2)
    finally:
        task.cancel()
    assert outbox_file.statuses() == ["published", "published"]


async def test_a_message_unanswered_even_on_trial_backs_off_and_is_abandoned(
    open_outbox: OpenOutbox,
) -> None:
    # Every publish of event 1 goes unanswered (a message the broker drops the connection
    # over), though the broker answers probes: a path fault the first time, but unanswered
    # again on trial it counts as an attempt, so it cannot circle between hosts for ever.
    outbox_file = await open_outbox(
        retry={"base_delay": 0.01, "max_delay": 0.01, "jitter": 0, "max_attempts": 3},
        circuit={"probe_max_delay": 0.01},
    )
    outbox_file.broker.handler = lambda m: (
        PublishResult.cut_off("connection lost") if number_of(m) == 1 else None
    )
    await outbox_file.stage(1, 2)
    processor = outbox_file.processor()

    for _ in range(200):
        await processor.drain()
        if outbox_file.statuses() == ["abandoned", "published"]:
            break
        await asyncio.sleep(0.01)

    first, second = outbox_file.rows()
    assert (first["status"], first["attempts"]) == ("abandoned", 3)
    assert first["last_error"] == "gave up after 3 attempts: connection lost"
    assert (second["status"], second["attempts"]) == ("published", 1)
    # Tried once more than counted: the first time it went back untried (a path fault).
    assert sum(1 for m in outbox_file.broker.attempts if number_of(m) == 1) >= 4


async def test_a_hanging_broker_is_found_silent_within_twice_the_silence_timeout(
    outbox_file: OutboxFile,
) -> None:
    processor = outbox_file.processor()
    await outbox_file.stage(1)
    assert await processor.drain() == 1  # the broker's answer time is known from now on
    outbox_file.broker.hang = True
    await outbox_file.stage(2, 3)
    loop = asyncio.get_running_loop()
    started = loop.time()

    assert await processor.drain() == 2

    # silence_timeout 0.25: unanswered for 0.25 s, then a ping unanswered for 0.25 s more.
    assert loop.time() - started < 1.0
    rows = outbox_file.rows()
    assert [(r["status"], r["attempts"]) for r in rows] == [("published", 1)] + [("pending", 0)] * 2
    assert processor.circuit.reason == (
        "events: no answer within 0.25 s, nor to a ping within 0.25 s: "
        "the path to the broker is silent"
    )


async def test_a_slow_publish_on_a_broker_whose_pings_are_slow_is_not_found_silent(
    open_outbox: OpenOutbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pings that take longer than publishes (a Service Bus ping attaches a link) are timed
    on their own: a publish that outlasts its limit is answered for by a ping within the
    pings' limit, not the publishes' one, and the healthy broker keeps its circuit closed."""
    timeouts = {"connect_timeout": 2, "publish_timeout": 2}
    outbox_file = await open_outbox(brokers={"events": {**EVENTS_BROKER, **timeouts}})
    broker = outbox_file.broker
    publish, ping = broker.publish, broker.ping
    slow = {"publish": 0.0}

    async def slow_ping() -> None:
        await asyncio.sleep(0.3)
        await ping()

    async def slow_publish(batch: list[OutgoingMessage]) -> list[PublishResult]:
        await asyncio.sleep(slow["publish"])
        return await publish(batch)

    monkeypatch.setattr(broker, "ping", slow_ping)
    monkeypatch.setattr(broker, "publish", slow_publish)
    processor = outbox_file.processor()
    await outbox_file.stage(1)
    assert await processor.drain() == 1
    await asyncio.sleep(0.4)  # the ping timing the new connection: 0.3 s
    for n in range(2, 22):  # quick publishes bring their limit down to silence_timeout
        await outbox_file.stage(n)
        assert await processor.drain() == 1

    slow["publish"] = 0.6  # past its 0.25 s limit: pinged, and the ping answers in 0.3 s
    await outbox_file.stage(22)
    assert await processor.drain() == 1

    assert not processor.circuit.is_open
    assert outbox_file.statuses() == ["published"] * 22


async def test_a_broker_that_never_answered_gets_the_whole_publish_timeout(
    outbox_file: OutboxFile,
) -> None:
    # Its first publish may include the connect, whose time is not known yet.
    outbox_file.broker.hang = True
    await outbox_file.stage(1, 2)
    loop = asyncio.get_running_loop()
    started = loop.time()
    processor = outbox_file.processor()

    assert await processor.drain() == 2

    # connect_timeout 0.2 + publish_timeout 0.2 + 1 s of slack bound one publish
    assert 1.0 < loop.time() - started < 3.0
    assert [(r["status"], r["attempts"]) for r in outbox_file.rows()] == [("pending", 0)] * 2
    assert processor.circuit.reason == "events: no answer within publish_timeout"


async def test_a_hanging_partner_does_not_hold_up_the_internal_broker(
    open_outbox: OpenOutbox,
) -> None:
    partner = {**EVENTS_BROKER, "internal": False}
    outbox_file = await open_outbox(brokers={"events": EVENTS_BROKER, "partner": partner})
    outbox_file.brokers["partner"].hang = True
    await outbox_file.stage(1, 2)
    partner_task = asyncio.create_task(outbox_file.processor(target="partner").drain())
    await wait_until(lambda: outbox_file.statuses("partner") == ["processing", "processing"])

    assert await outbox_file.processor(target="events").drain() == 2

    assert not partner_task.done()
    assert outbox_file.statuses("events") == ["published", "published"]
    assert numbers(outbox_file.broker) == [1, 2]
    await partner_task
    assert outbox_file.statuses("partner") == ["pending", "pending"]  # given back untried


async def test_a_full_batch_is_followed_at_once_by_the_next_claim(
    open_outbox: OpenOutbox,
) -> None:
    outbox_file = await open_outbox(batch_size=2)
    await outbox_file.stage(1, 2, 3, 4, 5)
    processor = outbox_file.processor()

    assert await processor.drain() == 5

    assert numbers(outbox_file.broker) == [1, 2, 3, 4, 5]
    assert outbox_file.statuses() == ["published"] * 5
    assert processor.stats.batches == 3


async def test_run_once_handles_one_batch(open_outbox: OpenOutbox) -> None:
    outbox_file = await open_outbox(batch_size=2)
    await outbox_file.stage(1, 2, 3)

    assert await outbox_file.processor().run_once() == 2

    assert outbox_file.statuses() == ["published", "published", "pending"]


async def test_a_failed_row_holds_back_its_stream_but_not_others(
    outbox_file: OutboxFile,
) -> None:
    outbox_file.broker.handler = refusing(2)
    await outbox_file.stage(1, 2, 3, stream_key="A")
    await outbox_file.stage(10, 11, stream_key="B")

    await outbox_file.processor().drain()

    assert outbox_file.statuses() == ["published", "failed", "pending", "published", "published"]
    assert numbers(outbox_file.broker) == [1, 10, 11]
    held = outbox_file.rows()[2]
    assert (held["attempts"], held["locked_by"]) == (0, None)


async def test_run_sleeps_until_woken_and_returns_on_stop(outbox_file: OutboxFile) -> None:
    """The poll interval is 60 s and nothing watches the file: only wake() brings news."""
    processor = outbox_file.processor()
    async with running(processor):
        await outbox_file.stage(1)
        processor.wake()
        await outbox_file.broker.wait_for(1, timeout=2)
        # A wake-up that came while it claimed 1 has it look once more: let that look end
        # before 2 is staged (under load it could otherwise find 2).
        await asyncio.sleep(0.2)

        await outbox_file.stage(2)
        await asyncio.sleep(0.3)
        assert numbers(outbox_file.broker) == [1]  # not woken: still asleep
        processor.wake()
        await outbox_file.broker.wait_for(2, timeout=2)
    assert outbox_file.statuses() == ["published", "published"]


async def test_with_a_linger_rows_staged_after_a_short_batch_go_without_a_wake_up(
    open_outbox: OpenOutbox,
) -> None:
    """outbox.linger: a short batch that sent rows is followed by another claim after the
    linger, not by the idle wait; an empty claim then sends the processor to sleep."""
    outbox_file = await open_outbox(linger=0.1)
    processor = outbox_file.processor()
    async with running(processor):
        await outbox_file.stage(1)
        processor.wake()
        await outbox_file.broker.wait_for(1, timeout=2)
        await outbox_file.stage(2)  # no wake-up: the claim after the linger finds it
        await outbox_file.broker.wait_for(2, timeout=2)
        await asyncio.sleep(0.5)  # the next claim after the linger finds nothing: asleep

        await outbox_file.stage(3)
        await asyncio.sleep(0.3)
        assert numbers(outbox_file.broker) == [1, 2]  # not woken: still asleep
        processor.wake()
        await outbox_file.broker.wait_for(3, timeout=2)
    assert outbox_file.statuses() == ["published"] * 3


async def test_a_processor_cancelled_mid_publish_gives_its_rows_back(
    outbox_file: OutboxFile,
) -> None:
    outbox_file.broker.hang = True
    await outbox_file.stage(1, 2)
    task = asyncio.create_task(outbox_file.processor().run())
    await wait_until(lambda: outbox_file.statuses() == ["processing", "processing"])

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert [(r["status"], r["attempts"], r["locked_by"]) for r in outbox_file.rows()] == [
        ("pending", 0, None),
        ("pending", 0, None),
    ]
    outbox_file.broker.hang = False
    assert await outbox_file.processor(worker="w2").drain() == 2
    assert numbers(outbox_file.broker) == [1, 2]


async def test_a_row_whose_lease_expired_is_claimed_by_another_worker(
    outbox_file: OutboxFile,
) -> None:
    store = outbox_file.store
    await outbox_file.stage(1)
    first = await store.claim("events", 10, "w1", lease_seconds=0.3)
    assert len(first) == 1
    assert len(await store.claim("events", 10, "w2", lease_seconds=30)) == 0  # still leased

    await asyncio.sleep(0.35)  # w1 died without marking
    second = await store.claim("events", 10, "w2", lease_seconds=30)

    assert [r.seq for r in second.rows] == [r.seq for r in first.rows]
    [row] = outbox_file.rows()
    assert (row["status"], row["locked_by"], row["attempts"]) == ("processing", "w2", 2)
    # The late first holder's mark is fenced off; the new holder's counts.
    await store.mark("events", first.token, Marks(published=[first.rows[0].seq]))
    assert outbox_file.statuses() == ["processing"]
    await store.mark("events", second.token, Marks(published=[second.rows[0].seq]))
    assert outbox_file.statuses() == ["published"]


async def test_a_processor_delivers_rows_a_dead_worker_left_behind(
    outbox_file: OutboxFile,
) -> None:
    await outbox_file.stage(1, 2)
    await outbox_file.store.claim("events", 10, "dead", lease_seconds=0.3)
    processor = outbox_file.processor(worker="w2")
    assert await processor.drain() == 0  # leased to a worker that may still be alive
    await asyncio.sleep(0.35)

    assert await processor.drain() == 2

    assert numbers(outbox_file.broker) == [1, 2]
    assert outbox_file.statuses() == ["published", "published"]


async def test_a_lease_shorter_than_a_publish_is_extended_before_the_first_wave(
    open_outbox: OpenOutbox,
) -> None:
    # The broker's publish may take 0.2 + 0.2 + 1 = 1.4 s: a 0.5 s lease is extended at once,
    # to 1.4 + 2 s, and that lasts the three waves of this stream.
    outbox_file = await open_outbox(lease_seconds=0.5)
    leases: list[timedelta] = []

    def note_lease(message: OutgoingMessage) -> None:
        [row] = [r for r in outbox_file.rows() if r["message_id"] == message.wire.message_id]
        leases.append(read_time(row["locked_until"]) - read_time(row["last_attempt_at"]))

    outbox_file.broker.handler = note_lease
    await outbox_file.stage(1, 2, 3, stream_key="order-1")

    assert await outbox_file.processor().run_once() == 3

    assert numbers(outbox_file.broker) == [1, 2, 3]
    assert outbox_file.statuses() == ["published"] * 3
    assert len(leases) == 3
    assert all(timedelta(seconds=3.3) < lease < timedelta(seconds=3.6) for lease in leases)


async def test_a_batch_whose_lease_cannot_be_extended_sends_nothing_and_gives_its_rows_back(
    open_outbox: OpenOutbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    outbox_file = await open_outbox(lease_seconds=0.5)

    async def unreachable(target: str, token: int, lease_seconds: float) -> int:
        raise DatabaseError("main: the database went away")

    monkeypatch.setattr(outbox_file.store, "extend", unreachable)
    await outbox_file.stage(1, 2)

    assert await outbox_file.processor().run_once() == 2

    assert outbox_file.broker.attempts == []
    assert [(r["status"], r["attempts"], r["locked_by"]) for r in outbox_file.rows()] == [
        ("pending", 0, None),
        ("pending", 0, None),
    ]


async def test_a_graceful_stop_finishes_the_wave_in_flight_and_gives_the_rest_back_at_once(
    outbox_file: OutboxFile,
) -> None:
    await outbox_file.stage(1, 2, 3, stream_key="order-1")  # one stream: three waves
    processor = outbox_file.processor()
    # SIGTERM arrives while the first wave is being published.
    outbox_file.broker.handler = lambda message: processor.stop()

    await asyncio.wait_for(processor.run(), 5)

    assert numbers(outbox_file.broker) == [1]
    assert [(r["status"], r["attempts"], r["locked_by"]) for r in outbox_file.rows()] == [
        ("published", 1, None),
        ("pending", 0, None),
        ("pending", 0, None),
    ]


async def test_a_backlog_on_one_stream_is_drained_without_waiting_for_a_wake_up(
    open_outbox: OpenOutbox,
) -> None:
    # Each claim made while a batch of the stream is in flight comes back empty (its rows
    # wait behind that batch): that must not read as "nothing left" (poll_interval is 60 s).
    outbox_file = await open_outbox(batch_size=10)
    await outbox_file.stage(*range(1, 31), stream_key="order-1")
    processor = outbox_file.processor()
    task = asyncio.create_task(processor.run())
    try:
        await wait_until(lambda: outbox_file.statuses() == ["published"] * 30, timeout=5)
    finally:
        processor.stop()
        await task
    assert numbers(outbox_file.broker) == list(range(1, 31))


async def test_an_idle_processor_takes_over_a_dead_workers_rows_when_their_lease_ends(
    outbox_file: OutboxFile,
) -> None:
    processor = outbox_file.processor(worker="alive")
    task = asyncio.create_task(processor.run())
    try:
        await outbox_file.stage(1)
        processor.wake()  # as the commit's notification would
        await wait_until(lambda: outbox_file.statuses() == ["published"])
        # The next commit wakes every worker; another one's claim takes the row, and that
        # worker dies. Nothing wakes the idle processor again (poll_interval is 60 s).
        await outbox_file.stage(2)
        await outbox_file.store.claim("events", 10, "dead", lease_seconds=0.5)
        processor.wake()
        await wait_until(lambda: outbox_file.statuses() == ["published"] * 2, timeout=3)
    finally:
        processor.stop()
        await task
    assert numbers(outbox_file.broker) == [1, 2]


async def test_a_paused_target_sleeps_through_wake_ups_and_delivers_once_resumed(
    outbox_file: OutboxFile,
) -> None:
    """With the log wake-up every commit wakes the relay: a paused target's processor claimed
    on each one, and each claim was turned down. It now asks whether it is paused when a claim
    finds nothing, and sleeps through wake-ups until it looks again (every 0.5 s)."""
    with sqlite3.connect(outbox_file.path) as db:
        db.execute("INSERT INTO router_targets (target, paused) VALUES ('events', 1)")
    await outbox_file.stage(1, 2)
    claims = 0
    claim = outbox_file.store.claim

    async def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal claims
        claims += 1
        return await claim(*args, **kwargs)

    outbox_file.store.claim = counted  # type: ignore[method-assign]
    processor = outbox_file.processor()
    running = asyncio.create_task(processor.run())
    try:
        for _ in range(300):  # 1.5 s of wake-ups, one every 5 ms, as commits would bring
            processor.wake()
            await asyncio.sleep(0.005)
        assert outbox_file.broker.messages == []
        assert claims <= 6, claims  # one look every 0.5 s, not one per wake-up
        with sqlite3.connect(outbox_file.path) as db:
            db.execute("UPDATE router_targets SET paused = 0 WHERE target = 'events'")
        processor.wake()  # what a resume sends, slept through until the next look
        for _ in range(100):
            if len(outbox_file.broker.messages) == 2:
                break
            await asyncio.sleep(0.01)
        assert numbers(outbox_file.broker) == [1, 2]
    finally:
        processor.stop()
        await running
