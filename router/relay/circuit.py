"""A per-target circuit breaker, one per host: stop claiming while this host cannot reach the
broker, probe, resume.

A publish that is not answered (no ack in time, a lost or refused connection) says that this
host's path to the broker is broken, not that the message is bad: the circuit opens at once,
the batch goes back untried, and the processor claims nothing for the target until a probe (a
fresh connection and a round trip) gets through. Other hosts, whose paths work, take the rows
meanwhile; on a single host, no row spends an attempt on the outage.

A probe that gets through puts the circuit *on trial*: it claims again, and the first publish
decides. Answered: the circuit is closed for good. Unanswered again: the path looks fine but
the publish is not (a message the broker drops the connection over, say), so that failure
counts as an attempt, with back-off, and the circuit opens again. A message that fails on
every host in turn therefore still backs off and is abandoned after ``max_attempts``, instead
of going from host to host for ever.

The workers of one ``router serve --workers N`` share it (``shared``, a word of
``router.relay.host_circuits``): one worker's opening stops its siblings' claims for the target
at once, and a probe that gets through puts them all on trial.

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
from router.relay.host_circuits import SharedWord
from router.relay.retry import retry_delay

__all__ = ["Circuit", "stale_after"]

log = logging.getLogger(__name__)

State = Literal["closed", "open"]

# Seconds from a circuit's opening to its first probe.
_FIRST_PROBE = 0.25
# The reason a worker gives when a sibling opened the circuit (its own words stay its own).
SIBLING = "another worker of this host found the broker unreachable"


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
        shared: SharedWord | None = None,
    ) -> None:
        self.settings = settings
        self._shared = shared
        self._seen = shared.read()[0] if shared is not None else 0
        # Probes back off like row retries do, but from a quarter of a second (a probe is one
        # connection and a round trip; the rows wait for it) up to their own ceiling.
        first = min(_FIRST_PROBE, settings.probe_max_delay)
        self._probe_schedule = retry.model_copy(
            update={"base_delay": first, "max_delay": settings.probe_max_delay}
        )
        self._clock = clock
        self._rand = rand
        self._labels = labels or {}
        self.state: State = "closed"
        self.reason: str | None = None
        self.unreachable_since: float | None = None
        self.probes = 0
        self.next_probe_at: float | None = None
        # Closed by a probe, and no publish answered since (see the module docstring).
        self.trial = False

    @property
    def is_open(self) -> bool:
        """True while the target is not being claimed (by this worker or a sibling's word)."""
        if self._shared is not None:
            self._follow(self._shared)
        return self.state == "open"

    def cut_off(self, error: str) -> None:
        """A publish went unanswered: open now (again, when on trial) and probe."""
        now = self._clock()
        self.reason = error
        if self.unreachable_since is None:
            self.unreachable_since = now
        self.trial = False
        if self.state == "open":
            return
        self._open(now)
        self._share(opened=True)
        log.warning(
            "circuit.opened",
            extra={
                **self._labels,
                "error": error,
                "unreachable_for": round(now - self.unreachable_since, 3),
            },
        )

    def probed(self) -> None:
        """A probe got through: claim again, on trial until a publish is answered."""
        if self.state == "open":
            log.info(
                "circuit.trial",
                extra={
                    **self._labels,
                    "probes": self.probes,
                    "outage": round(self._clock() - (self.unreachable_since or 0), 3),
                },
            )
        self._close_on_trial()
        self._share(opened=False)

    def reachable(self) -> None:
        """A publish was answered: the circuit is closed and the outage forgotten."""
        if self.state == "open":
            self._share(opened=False)
        if self.trial or self.state == "open":
            log.info(
                "circuit.closed",
                extra={
                    **self._labels,
                    "probes": self.probes,
                    "outage": round(self._clock() - (self.unreachable_since or 0), 3),
                },
            )
        self.state = "closed"
        self.trial = False
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

    def _open(self, now: float) -> None:
        self.state = "open"
        self.trial = False
        self.probes = 0
        self._schedule_probe(now)

    def _close_on_trial(self) -> None:
        self.state = "closed"
        self.trial = True
        self.next_probe_at = None

    def _share(self, *, opened: bool) -> None:
        """Tell the host's other workers (the generation written is not news to this one)."""
        if self._shared is not None:
            self._seen = self._shared.write(opened)

    def _follow(self, shared: SharedWord) -> None:
        """Take a sibling's news: opened (stop claiming, probe) or closed by its probe (claim
        again, on trial)."""
        generation, opened = shared.read()
        if generation == self._seen:
            return
        self._seen = generation
        if opened and self.state == "closed":
            now = self._clock()
            self.reason = self.reason or SIBLING
            if self.unreachable_since is None:
                self.unreachable_since = now
            self._open(now)
            log.warning("circuit.opened", extra={**self._labels, "error": SIBLING})
        elif not opened and self.state == "open":
            self._close_on_trial()
            log.info("circuit.trial", extra={**self._labels, "probed_by": "another worker"})

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
