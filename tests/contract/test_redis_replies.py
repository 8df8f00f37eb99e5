"""Redis-only: error replies that pass (out of memory, a failover, a load) are retried, not
abandoned; only a reply about the message itself (a key of the wrong type) is final; a refused
connection says so; ``maxlen`` trims each stream."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from brokers import create_broker
from brokers.redis import RedisSettings
from envelopes import BrokerUnavailable
from tests.contract.harnesses import REDIS_URL, RedisHarness
from tests.contract.test_contract import message
from tests.services import free_port


async def test_an_out_of_memory_reply_is_retryable_and_holds_back_its_stream(
    redis_harness: RedisHarness,
) -> None:
    settings = redis_harness.settings()
    destination = redis_harness.destination("oom")
    batch = [message(settings, destination, n, stream="s") for n in range(2)]
    admin = aioredis.Redis.from_url(REDIS_URL)
    before: str = (await admin.config_get("maxmemory"))["maxmemory"] or "0"
    broker = create_broker("partner", settings)
    try:
        await broker.connect()
        await admin.config_set("maxmemory", 1)  # every write is refused: OOM
        try:
            results = await broker.publish(batch)
        finally:
            await admin.config_set("maxmemory", before)
    finally:
        await broker.close()
        await admin.aclose()
    assert not results[0].ok and results[0].retryable
    assert "maxmemory" in (results[0].error or "")
    assert not results[1].ok and results[1].retryable  # not sent behind its predecessor
    assert "not sent" in (results[1].error or "")


async def test_a_refused_connection_says_so_with_the_address_and_without_the_password() -> None:
    port = free_port()
    settings = RedisSettings.model_validate(
        {
            "type": "redis",
            "url": f"redis://:Redis-S3cret@127.0.0.1:{port}/0",
            "destination": "shop:{event_type}",
            "connect_timeout": 1,
        }
    )
    broker = create_broker("cache", settings)
    try:
        with pytest.raises(BrokerUnavailable) as caught:
            await broker.connect()
    finally:
        await broker.close()
    assert str(caught.value) == (
        f"cache: cannot connect to Redis: redis://***@127.0.0.1:{port}/0: connection refused"
    )


async def test_maxlen_trims_the_stream_to_about_that_many_entries(
    redis_harness: RedisHarness,
) -> None:
    settings = redis_harness.settings(maxlen=10)
    destination = redis_harness.destination("trimmed")
    batch = [message(settings, destination, n, stream=None) for n in range(500)]
    broker = create_broker("partner", settings)
    try:
        results = await broker.publish(batch)
    finally:
        await broker.close()
    assert all(r.ok for r in results)
    admin = aioredis.Redis.from_url(REDIS_URL)
    try:
        length = await admin.xlen(destination)
    finally:
        await admin.aclose()
    # MAXLEN ~ trims whole nodes of the stream (100 entries each by default), never below 10.
    assert 10 <= length <= 110
