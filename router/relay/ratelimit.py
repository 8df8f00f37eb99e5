"""A target's rate limit: a token bucket the processor asks before each claim.

A claim takes only as many rows as there are tokens, so rows never sit leased while they wait
for their turn (a lease would run out, and a paused or stopping router would hold them). When
too few tokens are left, the processor waits until a twentieth of a second's worth (or the
whole bucket, if smaller) is back, rather than claiming one row at a time.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from brokers import RateLimit

__all__ = ["TokenBucket"]

# Claims a second at most while the limit holds the pace.
CLAIMS_PER_SECOND = 20


class TokenBucket:
    """``rate`` tokens a second, up to ``capacity``; starts full."""

    def __init__(self, limit: RateLimit, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = limit.messages_per_second
        self.capacity = limit.capacity
        self._clock = clock
        self._tokens = float(self.capacity)
        self._at = clock()
        self._held_since: float | None = None

    @property
    def least(self) -> int:
        """The fewest rows worth a claim."""
        return max(1, min(self.capacity, int(self.rate / CLAIMS_PER_SECOND)))

    def available(self) -> int:
        """Whole tokens now."""
        now = self._clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.rate)
        self._at = now
        return int(self._tokens + 1e-9)  # 0.1 s at 100/s is 10 tokens, not 9.999...

    def wait_for(self, count: int) -> float:
        """Seconds until ``count`` tokens are there (0 when they are)."""
        missing = count - self.available()
        return 0.0 if missing <= 0 else missing / self.rate

    def take(self, count: int) -> None:
        """Spend ``count`` tokens (rows claimed)."""
        self.available()
        self._tokens -= count

    def hold(self) -> None:
        """The limit holds claims back from now (if it was not already)."""
        if self._held_since is None:
            self._held_since = self._clock()

    def release(self) -> float:
        """Claims go on: the seconds they were held back (0 if they were not)."""
        since, self._held_since = self._held_since, None
        return 0.0 if since is None else self._clock() - since
