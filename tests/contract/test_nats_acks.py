"""NATS-only answers of JetStream that the contract suite does not cover: every reply is
turned into a result at once (none waits for publish_timeout), and each is classified."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator

import pytest

from brokers import OutgoingMessage, create_broker
from brokers.nats import _acks, _frames
from tests.contract.harnesses import NatsHarness
from tests.contract.test_contract import message
from tests.services import NATS, require


@pytest.fixture(params=["routed", "subscribed"])
async def harness(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[NatsHarness]:
    """Acks taken from the parser (``RoutingClient``), and through a plain subscription
    callback, as on a nats-py without the private hook."""
    require("NATS", NATS)
    monkeypatch.setattr(_acks, "ROUTED", request.param == "routed" and _acks.ROUTED)
    harness = NatsHarness()
    yield harness
    await harness.cleanup()


async def test_a_message_over_the_streams_size_limit_is_refused_at_once(
    harness: NatsHarness,
) -> None:
    settings = harness.settings(publish_timeout=20)
    await harness.prepare(harness.rejected_destination())
    broker = create_broker("partner", settings)
    started = time.monotonic()
    try:
        [result] = await broker.publish(
            [message(settings, harness.rejected_destination(), 1, stream=None)]
        )
    finally:
        await broker.close()
    assert time.monotonic() - started < 5  # answered, not timed out
    assert not result.ok
    assert result.retryable is False
    assert "message size exceeds maximum allowed" in (result.error or "")


async def test_a_subject_no_stream_captures_is_a_retryable_failure(harness: NatsHarness) -> None:
    # The stream was checked at connect; no responders later means it went away (or
    # JetStream is restarting): a row must wait and retry, not be abandoned.
    settings = harness.settings(publish_timeout=20)
    broker = create_broker("partner", settings)
    started = time.monotonic()
    try:
        await broker.connect()
        fine = message(settings, harness.destination("fine"), 1, stream=None)
        lost = message(settings, f"nowhere{harness.tag}.orders", 2, stream=None)
        results = await broker.publish([fine, lost])
    finally:
        await broker.close()
    assert time.monotonic() - started < 5
    assert results[0].ok
    assert not results[1].ok and results[1].retryable
    assert "no stream captures the subject" in (results[1].error or "")


async def test_a_repeated_message_id_is_acknowledged_and_stored_once(
    harness: NatsHarness,
) -> None:
    settings = harness.settings()
    destination = harness.destination("twice")
    once = message(settings, destination, 1, stream=None)
    broker = harness.broker("partner", settings)
    try:
        first = await broker.publish([once])
        again = await broker.publish([once])
    finally:
        await broker.close()
    assert first[0].ok and again[0].ok
    assert len(await harness.arrived_once(destination, 1, timeout=1)) == 1


def _with_header(message: OutgoingMessage, name: str) -> OutgoingMessage:
    wire = dataclasses.replace(message.wire, headers={**message.wire.headers, name: "x"})
    return OutgoingMessage(message.destination, wire)


async def test_a_message_nats_cannot_carry_is_refused_alone(harness: NatsHarness) -> None:
    settings = harness.settings()
    destination = harness.destination("refused")
    bad_name = _with_header(message(settings, destination, 1, stream="s"), "two words")
    too_large = message(settings, destination, 2, stream="s", size=2_000_000)
    fine = message(settings, destination, 3, stream="s")
    broker = create_broker("partner", settings)
    try:
        results = await broker.publish([bad_name, too_large, fine])
    finally:
        await broker.close()
    assert [(r.ok, r.retryable) for r in results] == [(False, False), (False, False), (True, True)]
    assert "header name 'two words'" in (results[0].error or "")
    assert "message too large" in (results[1].error or "")
    arrived = await harness.arrived(destination, 1)
    assert [json.loads(a.body)["payload"]["n"] for a in arrived] == [3]


async def test_a_window_nats_refuses_whole_gives_one_refusal_each(harness: NatsHarness) -> None:
    settings = harness.settings()
    destination = harness.destination("all-refused")
    batch = [_with_header(message(settings, destination, n, stream=None), "a b") for n in (1, 2)]
    broker = create_broker("partner", settings)
    try:
        results = await broker.publish(batch)
    finally:
        await broker.close()
    assert [(r.ok, r.retryable) for r in results] == [(False, False), (False, False)]


async def test_without_the_frame_writer_messages_go_through_client_publish(
    harness: NatsHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The frame writer uses nats-py's write queue, which is not public API; a nats-py
    # without it must still deliver, in order, through Client.publish.
    monkeypatch.setattr(_frames, "FRAMES", False)
    settings = harness.settings()
    destination = harness.destination("plain")
    batch = [message(settings, destination, n, stream="s") for n in range(30)]
    broker = create_broker("partner", settings)
    try:
        results = await broker.publish(batch)
        routed = isinstance(broker._client, _acks.RoutingClient)  # type: ignore[attr-defined]
    finally:
        await broker.close()
    assert all(r.ok for r in results)
    assert routed is _acks.ROUTED
    arrived = await harness.arrived(destination, 30)
    assert [json.loads(a.body)["payload"]["n"] for a in arrived] == list(range(30))
    assert {a.native_id for a in arrived} == {m.wire.message_id for m in batch}


def test_this_nats_py_lets_acks_be_routed() -> None:
    # The fast path is what the benchmarks measure: a nats-py upgrade that changes the hook
    # must be noticed here, not as a silent slowdown.
    assert _acks.ROUTED
