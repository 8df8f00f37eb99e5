"""The rate limit's token bucket, on a clock the test moves."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from brokers import RateLimit
from brokers.settings import RedisSettings
from router.relay.ratelimit import TokenBucket


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_full_bucket_allows_a_burst_then_refills_at_the_rate() -> None:
    clock = Clock()
    bucket = TokenBucket(RateLimit(messages_per_second=100, burst=20), clock)
    assert bucket.available() == 20
    bucket.take(20)
    assert bucket.available() == 0
    assert bucket.wait_for(bucket.least) == pytest.approx(bucket.least / 100)
    clock.now += 0.1
    assert bucket.available() == 10
    clock.now += 10  # never more than the burst
    assert bucket.available() == 20


def test_claims_wait_for_a_twentieth_of_a_second_not_for_one_row() -> None:
    assert TokenBucket(RateLimit(messages_per_second=2000)).least == 100
    assert TokenBucket(RateLimit(messages_per_second=2000, burst=50)).least == 50
    assert TokenBucket(RateLimit(messages_per_second=5)).least == 1


def test_the_time_held_back_is_measured_once() -> None:
    clock = Clock()
    bucket = TokenBucket(RateLimit(messages_per_second=10, burst=1), clock)
    bucket.hold()
    clock.now += 0.3
    bucket.hold()  # still the same spell
    clock.now += 0.2
    assert bucket.release() == pytest.approx(0.5)
    assert bucket.release() == 0.0


def test_config_takes_a_number_or_a_mapping_and_names_a_bad_value() -> None:
    base = {"type": "redis", "url": "redis://127.0.0.1:6379/0"}
    assert RedisSettings.model_validate({**base, "rate_limit": 200}).rate_limit == RateLimit(
        messages_per_second=200
    )
    limit = RedisSettings.model_validate(
        {**base, "rate_limit": {"messages_per_second": 5.5, "burst": 3}}
    ).rate_limit
    assert limit is not None and (limit.capacity, limit.messages_per_second) == (3, 5.5)
    with pytest.raises(ValidationError, match="rate_limit"):
        RedisSettings.model_validate({**base, "rate_limit": 0})
    with pytest.raises(ValidationError, match="on_backlog.action"):
        RedisSettings.model_validate({**base, "on_backlog": {"max_rows": 5, "action": "drop"}})
