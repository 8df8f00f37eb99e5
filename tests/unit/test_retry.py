"""The retry schedule: ``base_delay * 2^(attempt-1)``, capped at ``max_delay``, then ± jitter."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from router.config import RetrySettings
from router.relay.retry import delay_bounds, retry_delay

RETRY = RetrySettings(max_attempts=10, base_delay=1.5, max_delay=30.0, jitter=0.2)


def fixed(value: float) -> Callable[[], float]:
    """A ``rand`` that always draws ``value`` (0: shortest wait, 0.5: no jitter, 1: longest)."""
    return lambda: value


@pytest.mark.parametrize(
    ("attempt", "expected"),
    [(1, 1.5), (2, 3.0), (3, 6.0), (4, 12.0), (5, 24.0), (6, 30.0), (7, 30.0), (40, 30.0)],
)
def test_the_delay_doubles_per_attempt_from_the_base_up_to_the_cap(
    attempt: int, expected: float
) -> None:
    assert retry_delay(attempt, RETRY, fixed(0.5)) == pytest.approx(expected)


@pytest.mark.parametrize("attempt", [0, -3])
def test_attempt_numbers_below_one_count_as_the_first(attempt: int) -> None:
    assert retry_delay(attempt, RETRY, fixed(0.5)) == pytest.approx(1.5)


@pytest.mark.parametrize(
    ("attempt", "low", "high"), [(1, 1.2, 1.8), (3, 4.8, 7.2), (9, 24.0, 36.0)]
)
def test_jitter_spreads_each_delay_within_its_bounds(attempt: int, low: float, high: float) -> None:
    assert delay_bounds(attempt, RETRY) == pytest.approx((low, high))
    assert retry_delay(attempt, RETRY, fixed(0.0)) == pytest.approx(low)
    assert retry_delay(attempt, RETRY, fixed(1.0)) == pytest.approx(high)
    for rand in (0.1, 0.5, 0.9):
        assert low <= retry_delay(attempt, RETRY, fixed(rand)) <= high


def test_without_jitter_every_draw_gives_the_same_delay() -> None:
    exact = RETRY.model_copy(update={"jitter": 0.0})
    assert {retry_delay(3, exact, fixed(r)) for r in (0.0, 0.3, 1.0)} == {6.0}


def test_the_default_draw_stays_within_the_bounds() -> None:
    low, high = delay_bounds(4, RETRY)
    assert all(low <= retry_delay(4, RETRY) <= high for _ in range(1000))


@pytest.mark.parametrize("attempt", [64, 1025, 10**6, 2**80])
def test_huge_attempt_numbers_stay_capped_without_overflowing(attempt: int) -> None:
    delay = retry_delay(attempt, RETRY, fixed(1.0))
    assert math.isfinite(delay)
    assert delay == pytest.approx(36.0)


def test_max_delay_below_base_delay_is_refused() -> None:
    with pytest.raises(ValueError, match="max_delay must be at least base_delay"):
        RetrySettings(base_delay=5, max_delay=1)
