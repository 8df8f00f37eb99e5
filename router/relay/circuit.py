"""A per-target circuit breaker: stop claiming while a broker is unreachable, probe, resume.

Short blips are ridden out by each row's own retries. When a broker stays unreachable for
``open_after`` seconds, the circuit opens: the processor claims nothing, so no row spends an
attempt on an outage, and it probes the broker (connect + ping) at growing intervals instead.
The first probe that succeeds closes the circuit and delivery resumes where it stopped.
``reason`` keeps the latest failure (the broker's own words: "cannot connect", "stream 'X' does
not exist ...") while the target is failing or open.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Literal

from router.config import CircuitSettings, OutboxSettings, RetrySettings
from router.relay.retry import retry_delay

__all__ = ["Circuit", "stale_after"]

log = logging.getLogger(__name__)

State = Literal["closed", "open"]


class Circuit:
    """The breaker of one target; the processor reports outcomes and asks when to probe."""

    def __init__(
        self,
        settings: CircuitSettings,
        retry: RetrySettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        rand: Callable[[], float] = random.random,
        labels: dict[str, str] | None = None,
    ) -> None:
        self.settings = settings
        # Probes back off like row retries do, but up to their own ceiling.
        self._probe_schedule = retry.model_copy(update={"max_delay": settings.probe_max_delay})
        self._clock = clock
        self._rand = rand
        self._labels = labels or {}
        self.state: State = "closed"
        self.reason: str | None = None
        self.unreachable_since: float | None = None
        self.probes = 0
        self.next_probe_at: float | None = None

    @property
    def is_open(self) -> bool:
        """True while the target is not being claimed."""
        return self.state == "open"

    def unreachable(self, error: str) -> None:
        """The broker could not be reached; open once that has lasted ``open_after``."""
        now = self._clock()
        self.reason = error
        if self.unreachable_since is None:
            self.unreachable_since = now
        if self.state == "closed" and now - self.unreachable_since >= self.settings.open_after:
            self.state = "open"
            self.probes = 0
            self._schedule_probe(now)
            log.warning(
                "circuit.opened",
                extra={
                    **self._labels,
                    "error": error,
                    "unreachable_for": round(now - self.unreachable_since, 3),
                },
            )

    def reachable(self) -> None:
        """The broker answered: close the circuit (if open) and forget the outage."""
        if self.state == "open":
            log.info(
                "circuit.closed",
                extra={
                    **self._labels,
                    "probes": self.probes,
                    "outage": round(self._clock() - (self.unreachable_since or 0), 3),
                },
            )
        self.state = "closed"
        self.reason = None
        self.unreachable_since = None
        self.next_probe_at = None

    def probe_failed(self, error: str) -> None:
        """A probe failed: wait longer before the next."""
        self.reason = error
        self._schedule_probe(self._clock())
        log.info(
            "circuit.probe_failed",
            extra={
                **self._labels,
                "probes": self.probes,
                "error": error,
                "next_probe_in": round((self.next_probe_at or 0) - self._clock(), 3),
            },
        )

    def probe_in(self) -> float:
        """Seconds until the next probe is due (0 when due now)."""
        if self.next_probe_at is None:
            return 0.0
        return max(0.0, self.next_probe_at - self._clock())

    def _schedule_probe(self, now: float) -> None:
        self.probes += 1
        self.next_probe_at = now + retry_delay(self.probes, self._probe_schedule, self._rand)


def stale_after(outbox: OutboxSettings, connect_timeout: float) -> float:
    """Seconds after which an open circuit's record, not renewed, is a dead process's.

    A live processor records its open circuit again after every probe (its heartbeat): two
    records are at most the longest probe wait (with jitter) plus a probe (connect and ping)
    apart. Twice that tolerates one late beat.
    """
    wait = outbox.circuit.probe_max_delay * (1 + outbox.retry.jitter)
    return 2 * (wait + 2 * connect_timeout + 1)
