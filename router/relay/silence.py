"""How long a broker may leave a publish unanswered before this host suspects its path.

A fixed limit is either too long (a host cut off from its broker holds its batch, and on
PostgreSQL the whole target, for that long) or too short for a broker that is merely far or
busy (a healthy host would give its rows away for nothing). So the limit follows the broker's
own answer times, as TCP sets its retransmission timeout (RFC 6298): the smoothed answer time
plus four times its variation, never below the configured ``silence_timeout`` and never above
``publish_timeout``.
"""

from __future__ import annotations

__all__ = ["AnswerTime"]


class AnswerTime:
    """The running estimate of one broker's answer time, and the limit it gives."""

    def __init__(self, floor: float, ceiling: float) -> None:
        self.floor = floor
        self.ceiling = max(floor, ceiling)
        self.smoothed: float | None = None
        self.variation = 0.0
        self._fresh = True  # no answer timed on the current connection yet

    @property
    def known(self) -> bool:
        """True once an answer time was measured on the current connection: the first
        publish on a connection includes the connect (and, on some brokers, a token and a
        link per destination), so it is not watched; a ping after it gives the first time."""
        return self.smoothed is not None and not self._fresh

    @property
    def limit(self) -> float:
        """Seconds a publish, or then a ping, may go unanswered."""
        if self.smoothed is None:
            return self.floor
        return min(self.ceiling, max(self.floor, self.smoothed + 4 * self.variation))

    def reconnected(self) -> None:
        """The connection is new: nothing is watched until it has answered once."""
        self._fresh = True

    def observe(self, seconds: float) -> None:
        """One answer on the current connection took ``seconds``."""
        self._fresh = False
        if self.smoothed is None:
            self.smoothed, self.variation = seconds, seconds / 2
            return
        self.variation = 0.75 * self.variation + 0.25 * abs(self.smoothed - seconds)
        self.smoothed = 0.875 * self.smoothed + 0.125 * seconds
