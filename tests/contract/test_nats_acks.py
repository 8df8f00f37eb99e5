"""NATS-only answers of JetStream that the contract suite does not cover: every reply is
turned into a result at once (none waits for publish_timeout), and each is classified."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

from brokers import create_broker
from tests.contract.harnesses import NatsHarness
from tests.contract.test_contract import message
from tests.services import NATS, require


@pytest.fixture
async def harness() -> AsyncIterator[NatsHarness]:
    require("NATS", NATS)
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
    broker = create_broker("partner", settings)
    try:
        first = await broker.publish([once])
        again = await broker.publish([once])
    finally:
        await broker.close()
    assert first[0].ok and again[0].ok
    assert len(await harness.arrived(destination, 1, timeout=1)) == 1
