"""The processor: drains one target (one database, one broker).

Each cycle claims a batch of due rows under a lease, hands it to ``Delivery`` (render, publish
in waves with acks in flight, classify), and writes the outcomes back with one statement per
kind: published; failed with ``available_at = now + backoff``; abandoned after
``max_attempts`` or when the broker says retrying cannot help.

The processor schedules: it wakes, waits, probes while its ``BrokerLink`` is cut off, and
stops. How batches follow each other is the loop the store names (``OutboxStore.pump``,
``router.relay.pumps``): claims beside publishing where a claim commits at once, runs of one
transaction on PostgreSQL, where a claim that finds another worker's batch in flight is asked
again after a short wait, doubling up to a tenth of a second.

A batch split into many waves may take longer than ``outbox.lease_seconds``: before each wave,
a lease with less than one publish (and a second) left is extended (``router.relay.lease``),
and a batch whose rows were taken over meanwhile sends no further wave.

It wakes on new rows (NOTIFY, the SQLite watcher, or an in-process signal), when the earliest
retry falls due, and on a slow fallback poll; it never sleeps while a full batch is waiting.
A failing, slow or hanging broker only delays its own processor: every processor is its own
task with its own connection, and nothing it waits for is shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Callable

from brokers import Broker, BrokerSettings
from envelopes import DatabaseError
from router.config import OutboxSettings
from router.relay.circuit import Circuit
from router.relay.delivery import Delivery, Render
from router.relay.host_circuits import SharedWord
from router.relay.lease import Lease
from router.relay.link import BrokerLink
from router.relay.metrics import Metrics
from router.relay.ratelimit import TokenBucket
from router.relay.stats import ProcessorStats
from router.relay.store import BatchLost, Claim, Marks, OutboxStore
from router.relay.streams import RunStreams

__all__ = ["Processor", "ProcessorStats"]

log = logging.getLogger(__name__)

# How often an idle processor asks when the next retry or lease end comes, at most (seconds).
_DUE_RECHECK = 1.0
# A paused target's processor sleeps through wake-ups and looks again this often (seconds),
# so a resume takes effect within it. Every wake-up would otherwise cost a claim that the
# pause turns down: with the log wake-up a commit is a wake-up, and a paused relay on a busy
# PostgreSQL ran about 600 empty claims a second (bench.write_concurrency --relay).
_PAUSE_RECHECK = 0.5
# Back-off after a cycle failed (database down, or a bug): from half a second to 30 s.
_PAUSE_MIN, _PAUSE_MAX = 0.5, 30.0
# How long to wait before asking again when another worker's batch holds the target (seconds):
# from a batch's publish to a tenth of a second. No commit wakes a worker that waits so (its
# stagers notify only idle relays, router/_wakeup.py), so this is how late it takes over
# when that batch ends, or its worker is cut off from the broker and gives its rows back. A
# busy claim returns at once (a try of the target's lock), so ten a second cost nothing.
_BUSY_MIN, _BUSY_MAX = 0.02, 0.1


class Processor:
    """One target's delivery loop; ``run()`` until ``stop()``, or ``drain()`` in tests."""

    def __init__(
        self,
        *,
        database: str,
        target: str,
        settings: BrokerSettings,
        broker: Broker,
        store: OutboxStore,
        outbox: OutboxSettings,
        worker_id: str,
        rand: Callable[[], float] = random.random,
        metrics: Metrics | None = None,
        render: Render | None = None,
        shared_circuit: SharedWord | None = None,
    ) -> None:
        """``shared_circuit``: the target's word in the host's circuits, in a worker of
        ``router serve --workers N`` (``router.relay.host_circuits``)."""
        self.database = database
        self.target = target
        self.settings = settings
        self.store = store
        self.outbox = outbox
        self.worker_id = worker_id
        self.stats = ProcessorStats()
        self._log = {"database": database, "target": target}
        self.link = BrokerLink(
            broker,
            settings,
            Circuit(
                outbox.circuit, outbox.retry, rand=rand, labels=self._log, shared=shared_circuit
            ),
            stats=self.stats,
            labels=self._log,
            metrics=metrics,
        )
        self.delivery = Delivery(
            target=target,
            settings=settings,
            link=self.link,
            retry=outbox.retry,
            stats=self.stats,
            rand=rand,
            labels=self._log,
            metrics=metrics,
            render=render,
            stopping=lambda: self._stopping,
        )
        self._recorded_circuit = "closed"
        self._recorded_probes = 0  # an open circuit is recorded again after every probe
        self._wake = asyncio.Event()
        self._drained = False  # the last pump claimed all there was (see _going_idle)
        self._sent = False  # the last pump claimed rows to send (see idle_timeout)
        self._lingering = False  # the last pump asked to claim again after outbox.linger
        self._stopping = False
        self._check_due = True  # look for rows waiting to retry (at start and after failures)
        self._next_due: float | None = None
        self._due_checked_at = -math.inf
        self._pause_checked_at = -math.inf
        self._paused_until = -math.inf  # time.monotonic() until which wake-ups are slept through
        self._in_flight: dict[int, Claim] = {}  # claims not yet marked, by token
        self._busy_wait = _BUSY_MIN
        self._pump = store.pump(self)  # the delivery loop the store's claims need
        limit = settings.rate_limit
        self.bucket = TokenBucket(limit) if limit is not None else None
        self._metrics = metrics
        if metrics is not None:
            metrics.start_target(database, target)

    @property
    def circuit(self) -> Circuit:
        """This host's circuit for the target (the link's)."""
        return self.link.circuit

    @property
    def name(self) -> str:
        """``database/target``."""
        return f"{self.database}/{self.target}"

    def wake(self) -> None:
        """New rows may be waiting: look now (a paused target: at its next look)."""
        if self._paused_until > time.monotonic():
            return
        self._wake.set()

    def stop(self) -> None:
        """Finish the batches in flight, then return from ``run()``.

        A batch still waiting for its broker connection has sent nothing: its connect is
        cancelled and the batch given back, rather than holding shutdown for connect_timeout.
        """
        self._stopping = True
        self._wake.set()
        self.link.stop()

    async def run(self) -> None:
        """Deliver until ``stop()``; on cancellation, give back what was claimed."""
        log.info("processor.started", extra={**self._log, "worker": self.worker_id})
        pause = _PAUSE_MIN
        try:
            while not self._stopping:
                self._wake.clear()
                self._drained = self._sent = self._lingering = False
                try:
                    if self.circuit.is_open:  # only the broker is asked
                        timeout = await self.link.probe()
                    else:
                        timeout = await self._pump()
                        self.store.outage.recovered()
                    pause = _PAUSE_MIN
                except asyncio.CancelledError:
                    if not self.link.stopped_connect():
                        raise
                    break
                except Exception as exc:  # the loop must outlive a database outage, or a bug
                    self._report(exc, pause)
                    timeout, pause = pause, min(pause * 2, _PAUSE_MAX)
                    self._check_due = True
                await self._record_circuit()
                if timeout is None or self._stopping:
                    continue
                if self.circuit.is_open:
                    # Cut off at the end of a pump: probe when due, not at the next poll (a
                    # minute by default), or an outage with nothing staged after it would
                    # outlast the broker's return by that long.
                    timeout = min(timeout, self.circuit.probe_in())
                elif self._drained:  # not for a rate limit's or another batch's wait
                    timeout = await self._going_idle(timeout)
                    if timeout <= 0:
                        continue
                elif self._lingering:
                    # Rows keep coming (idle_timeout): the whole linger, which a wake-up for
                    # each commit (the log, the binlog, SQLite's watcher) would cut short.
                    await asyncio.sleep(timeout)
                    continue
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)
                if self._wake.is_set():
                    self.store.busy(self.target)  # woken: no longer idle
        finally:
            await self._shutdown()
            log.info("processor.stopped", extra={**self._log, "published": self.stats.published})

    async def _going_idle(self, timeout: float) -> float:
        """How long to wait, once the store knows this processor waits for new rows (on
        PostgreSQL, from then on the target's stagers notify; see ``OutboxStore.idle``)."""
        try:
            look_again = await self.store.idle(self.target)
        except Exception as exc:  # the wait must happen; the next claim reports the outage
            log.debug("processor.idle_failed", extra={**self._log, "error": str(exc)})
            return timeout
        return timeout if look_again is None else min(timeout, look_again)

    async def drain(self, max_cycles: int = 10_000) -> int:
        """Burst mode: deliver every row that is due now, then return how many were handled."""
        total = 0
        for _ in range(max_cycles):
            handled = await self.run_once()
            total += handled
            if handled == 0:
                break
        return total

    async def run_once(self) -> int:
        """One cycle, without overlap: claim, publish, mark. Returns the rows handled (none
        while the circuit is open and its probe fails or is not due)."""
        if self.circuit.is_open and (self.circuit.probe_in() > 0 or await self.link.probe()):
            return 0
        limit = self.claim_limit()
        if limit == 0:
            await asyncio.sleep(self.token_wait())
            limit = self.claim_limit()
        claim, end = await self.claim(limit)
        if claim.rows:
            await self.deliver_and_mark(claim, end)
        return len(claim)

    # The batch operations a pump drives (router.relay.pumps.Cycle).

    @property
    def halted(self) -> bool:
        """Stopping, or cut off from the broker: claim nothing more."""
        return self._stopping or self.link.is_open

    def busy(self) -> float:
        """How long to wait before asking again for a target another batch holds."""
        wait, self._busy_wait = self._busy_wait, min(self._busy_wait * 2, _BUSY_MAX)
        return wait

    def not_busy(self) -> None:
        """A claim got through: the next busy wait starts short again."""
        self._busy_wait = _BUSY_MIN

    def hold(self, claim: Claim) -> None:
        """Count a batch as in flight until it is marked or given back (``_shutdown``)."""
        self._in_flight[claim.token] = claim

    async def give_back(self, claims: list[Claim]) -> None:
        """Batches that were claimed and will not be published (a run ended first, or
        failed): given back untried, so that the run's transaction can end."""
        for claim in claims:
            self._in_flight.pop(claim.token, None)
            if claim.rows:
                with contextlib.suppress(Exception):
                    await asyncio.shield(
                        self.store.release(self.target, claim.token, [r.seq for r in claim.rows])
                    )

    def claim_limit(self) -> int:
        """Rows the next claim may take: a batch, or what the rate limit has tokens for
        (0: too few to be worth a claim yet)."""
        if self.bucket is None:
            return self.outbox.batch_size
        tokens = self.bucket.available()
        if tokens < self.bucket.least:
            self.bucket.hold()
            return 0
        held = self.bucket.release()
        if held and self._metrics is not None:
            self._metrics.rate_limited.labels(self.database, self.target).inc(held)
        return min(self.outbox.batch_size, tokens)

    def token_wait(self) -> float:
        """Seconds until the rate limit allows the next claim."""
        assert self.bucket is not None
        return self.bucket.wait_for(self.bucket.least)

    async def claim(self, limit: int, after: Claim | None = None) -> tuple[Claim, float]:
        """A claim of ``limit`` rows at most (in ``after``'s transaction, when given), and
        when its lease ends on the event loop's clock: counted from before the claim was sent,
        so never later than the database's end. The rows it took are spent from the rate
        limit's tokens."""
        sent = asyncio.get_running_loop().time()
        claim = await self.store.claim(
            self.target,
            limit,
            self.worker_id,
            self.outbox.lease_seconds,
            after,
            units=self.settings.atomic,
        )
        if self.bucket is not None:
            self.bucket.take(len(claim))
        # Rows to send: not idle now (found unwoken, a due retry, say). An atomic claim that
        # holds only parts of units (a member held, parked or under another claim) sends
        # nothing: that is no work, and giving the wake lock back for it made the look at each
        # idle claim those rows again at once, hundreds of times a second on PostgreSQL.
        if any(row.whole for row in claim.rows):
            self.store.busy(self.target)
            self._sent = True
        return claim, sent + self.outbox.lease_seconds

    async def deliver_and_mark(self, claim: Claim, end: float) -> None:
        """Publish a batch and write its outcomes. Until they are written, a cancelled batch
        (shutdown past its grace period) is given back by ``_shutdown``."""
        self._in_flight[claim.token] = claim
        marks, deadline = await self.deliver(claim, end)
        if marks is not None:
            await self.finish(claim, marks, deadline)

    async def deliver(
        self, claim: Claim, end: float, streams: RunStreams | None = None
    ) -> tuple[Marks | None, float]:
        """Publish a claimed batch under its lease: the outcomes (None when ``stop()``
        cancelled a connect: the batch stays in flight, for _shutdown to give back) and the
        lease's end, until which marking may be retried. ``streams``: what the run's earlier
        batches left of their streams (``RunStreams``)."""
        lease = Lease(
            self.store,
            self.target,
            claim,
            seconds=self.outbox.lease_seconds,
            end=end,
            labels=self._log,
        )
        try:
            marks = await self.delivery.deliver(claim.rows, lease.keep, streams)
        except asyncio.CancelledError:
            if not self.link.stopped_connect():
                raise
            # A reconnect between two waves is cancelled too; the earlier waves' rows are then
            # sent again (at-least-once).
            return None, lease.end
        except Exception:
            self._in_flight.pop(claim.token, None)
            raise
        return marks, lease.end

    async def finish(
        self,
        claim: Claim,
        marks: Marks,
        deadline: float,
        before: asyncio.Task[None] | None = None,
    ) -> None:
        """Write a batch's outcomes (after ``before``, the mark of the batch before it in its
        transaction, so they are written in order)."""
        follows_lost = await _lost(before)
        if marks.failed or marks.abandoned:
            self._check_due = True
        try:
            await self._mark(claim.token, marks, deadline, follows_lost=follows_lost)
        finally:
            # Written, or not (the database is away): a lease, or the end of the batch's
            # transaction, brings the rows back.
            self._in_flight.pop(claim.token, None)
        self.stats.batches += 1

    async def idle_timeout(self, handled: int, limit: int) -> float | None:
        """None to go on at once; otherwise how long to wait for a wake-up.

        Nothing wakes a processor when a retry falls due or when another worker's lease ends
        (that worker, or its whole host, may be dead): it asks the store when the next of
        those comes after its own failures, after a cycle that found nothing to claim (woken
        with the others by a commit another worker's claim took), and otherwise at most once
        every ``_DUE_RECHECK`` seconds as it goes idle. So an idle processor takes a dead
        host's rows over when their lease ends, not a ``poll_interval`` later, and a busy one
        adds at most one query a second.
        """
        if handled >= limit:  # a full claim: there may be more
            return None
        if handled and self._sent and self.outbox.linger:
            # A short batch that sent rows: more are likely on their way. Claim again after
            # the linger rather than go idle, so that they come in one batch, not one each,
            # and (PostgreSQL) the stagers meanwhile notify no one (docs/production.md).
            self._lingering = True
            return self.outbox.linger
        self._drained = True  # nothing left to claim now: wait for new rows
        loop = asyncio.get_running_loop()
        if handled == 0 and loop.time() - self._pause_checked_at >= _PAUSE_RECHECK:
            # An empty claim may be a paused target's: ask, at most every _PAUSE_RECHECK.
            self._pause_checked_at = loop.time()
            if await self.store.paused(self.target):
                self._paused_until = time.monotonic() + _PAUSE_RECHECK
                return _PAUSE_RECHECK
            self._paused_until = -math.inf
        recheck = handled == 0 or loop.time() - self._due_checked_at >= _DUE_RECHECK
        if self._check_due or recheck:
            due = await self.store.next_due(self.target)
            self._due_checked_at = loop.time()
            self._check_due = False
            self._next_due = None if due is None else self._due_checked_at + due
        timeout = self.outbox.poll_interval
        if self._next_due is not None:
            remaining = self._next_due - loop.time()
            if remaining <= 0:
                self._next_due, self._check_due = None, True
                return 0.0 if handled else 0.05
            timeout = min(timeout, remaining + 0.005)
        return timeout

    async def _mark(
        self, token: int, marks: Marks, deadline: float, *, follows_lost: bool = False
    ) -> None:
        """Write outcomes back, retrying until ``deadline``, the lease's end on the loop's
        clock (marks are idempotent; past it, the rows may be claimed and sent again).

        ``follows_lost``: the batch before it in its transaction was lost, and this one with
        it; that loss was logged, so this one is logged at debug only.
        """
        loop = asyncio.get_running_loop()
        delay = 0.1
        while True:
            try:
                await self.store.mark(self.target, token, marks)
                return
            except DatabaseError as exc:
                # A lost batch cannot be marked later either: its transaction is gone.
                if isinstance(exc, BatchLost) or loop.time() + delay > deadline:
                    log.log(
                        logging.DEBUG if follows_lost else logging.ERROR,
                        "batch.mark_failed",
                        extra={**self._log, "rows": len(marks), "error": str(exc)},
                    )
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _record_circuit(self) -> None:
        """Make a change of circuit state visible to `router status` (best effort).

        An open circuit is recorded again after each probe, which stamps it anew: that is its
        heartbeat. A record not renewed within ``circuit.stale_after`` is a dead process's, and
        status shows it as stale, not as the target's state now.
        """
        state = self.circuit.state
        beat = state == "open" and self.circuit.probes != self._recorded_probes
        if state == self._recorded_circuit and not beat:
            return
        try:
            await self.store.record_circuit(
                self.target,
                state,
                self.worker_id,
                (self.stats.last_error or self.circuit.reason) if state == "open" else None,
            )
        except Exception:  # the database may be what is down; try again next cycle
            return
        self._recorded_circuit, self._recorded_probes = state, self.circuit.probes

    async def _forget_circuit(self) -> None:
        """On a graceful stop: an open circuit recorded here is nobody's once this processor
        is gone, so record it closed (the next processor opens it again if need be)."""
        if self._recorded_circuit != "open":
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                self.store.record_circuit(self.target, "closed", self.worker_id, None), 5
            )

    def _report(self, exc: Exception, pause: float) -> None:
        if isinstance(exc, DatabaseError):
            # One line when the outage starts (and one when it ends), not one per retry.
            self.store.outage.failed(str(exc), target=self.target, retry_in=pause)
        else:
            log.exception("processor.error", extra={**self._log, "retry_in": pause})

    async def _shutdown(self) -> None:
        """Give back rows claimed but not marked (cancelled mid-batch), then disconnect."""
        claims, self._in_flight = list(self._in_flight.values()), {}
        for claim in claims:
            with contextlib.suppress(Exception):
                seqs = [r.seq for r in claim.rows]
                await asyncio.shield(self.store.release(self.target, claim.token, seqs))
                log.info("batch.released", extra={**self._log, "rows": len(seqs)})
        await self._forget_circuit()
        await self.link.disconnect()


async def _lost(mark: asyncio.Task[None] | None) -> bool:
    """Wait for ``mark`` (a batch's mark task, if any) and say whether it failed.

    Its failure is read here, by the mark chained after it: the run awaits only its last
    mark, and asyncio reports a task's exception nobody read ("Task exception was never
    retrieved", with a traceback) when a database connection is cut mid-run. The failure
    itself was logged where it happened (``batch.mark_failed``).
    """
    if mark is None:
        return False
    await asyncio.wait({mark})
    return not mark.cancelled() and mark.exception() is not None
