"""The retry schedule: ``base_delay * 2^(attempt-1)``, capped at ``max_delay``, ± ``jitter``."""

from __future__ import annotations

import random
from collections.abc import Callable

from router.config import RetrySettings

__all__ = ["delay_bounds", "retry_delay"]


def _capped(attempt: int, retry: RetrySettings) -> float:
    exponent = min(max(attempt, 1) - 1, 62)  # beyond 2^62 every delay is capped anyway
    return min(retry.max_delay, retry.base_delay * 2.0**exponent)


def retry_delay(
    attempt: int, retry: RetrySettings, rand: Callable[[], float] = random.random
) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
    low, high = delay_bounds(attempt, retry)
    return low + (high - low) * rand()


def delay_bounds(attempt: int, retry: RetrySettings) -> tuple[float, float]:
    """The shortest and longest wait after attempt number ``attempt``."""
    delay = _capped(attempt, retry)
    return (delay * (1 - retry.jitter), delay * (1 + retry.jitter))
