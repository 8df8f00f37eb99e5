"""The processor: drains one target (one database, one broker).

Each cycle claims a batch of due rows under a lease, renders each row's envelope for the
broker's profile, publishes the batch with acks in flight, and writes the outcomes back with
one statement per kind: published; failed with ``available_at = now + backoff``; abandoned
after ``max_attempts`` or when the broker says retrying cannot help.

It wakes on new rows (NOTIFY, the SQLite watcher, or an in-process signal), when the earliest
retry falls due, and on a slow fallback poll; it never sleeps while a full batch is waiting.
A failing, slow or hanging broker only delays its own processor: every processor is its own
task with its own connection, and nothing it waits for is shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from brokers import Broker, BrokerSettings, OutgoingMessage, PublishResult
from envelopes import BrokerError, DatabaseError, EnvelopeError, render
from router._store import Claim, ClaimedRow, Marks, OutboxStore
from router.circuit import Circuit
from router.config import OutboxSettings
from router.retry import retry_delay

__all__ = ["Processor", "ProcessorStats"]

log = logging.getLogger(__name__)

# Back-off after a cycle failed (database down, or a bug): from half a second to 30 s.
_PAUSE_MIN, _PAUSE_MAX = 0.5, 30.0


@dataclass(slots=True)
class ProcessorStats:
    """Counters since the processor started."""

    published: int = 0
    failed: int = 0
    abandoned: int = 0
    batches: int = 0
    last_error: str | None = None


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
    ) -> None:
        self.database = database
        self.target = target
        self.settings = settings
        self.broker = broker
        self.store = store
        self.outbox = outbox
        self.worker_id = worker_id
        self.stats = ProcessorStats()
        self._rand = rand
        self._wake = asyncio.Event()
        self._stopping = False
        self._check_due = True  # look for rows waiting to retry (at start and after failures)
        self._next_due: float | None = None
        self._claimed: Claim | None = None
        self._log = {"database": database, "target": target}
        self.circuit = Circuit(outbox.circuit, outbox.retry, rand=rand, labels=self._log)

    @property
    def name(self) -> str:
        """``database/target``."""
        return f"{self.database}/{self.target}"

    def wake(self) -> None:
        """New rows may be waiting: look now."""
        self._wake.set()

    def stop(self) -> None:
        """Finish the batch in flight, then return from ``run()``."""
        self._stopping = True
        self._wake.set()

    async def run(self) -> None:
        """Deliver until ``stop()``; on cancellation, release what was claimed."""
        log.info("processor.started", extra={**self._log, "worker": self.worker_id})
        pause = _PAUSE_MIN
        try:
            while not self._stopping:
                self._wake.clear()
                try:
                    if self.circuit.is_open:
                        timeout = await self._probe()
                    else:
                        handled = await self.run_once()
                        timeout = await self._idle_timeout(handled)
                    pause = _PAUSE_MIN
                except Exception as exc:  # the loop must outlive a database outage, or a bug
                    self._report(exc, pause)
                    timeout, pause = pause, min(pause * 2, _PAUSE_MAX)
                    self._check_due = True
                if timeout is None or self._stopping:
                    continue
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)
        finally:
            await self._shutdown()
            log.info("processor.stopped", extra={**self._log, "published": self.stats.published})

    async def _probe(self) -> float | None:
        """Circuit open: once a probe is due, try the broker. None: closed again, go on."""
        wait = self.circuit.probe_in()
        if wait > 0:
            return wait
        limit = self.settings.connect_timeout * 2 + 1
        try:
            await asyncio.wait_for(self._connect_and_ping(), limit)
        except (BrokerError, TimeoutError) as exc:
            self.circuit.probe_failed(str(exc) or "no answer within the timeout")
            await self._disconnect()
            return self.circuit.probe_in()
        self.circuit.reachable()
        return None

    async def _connect_and_ping(self) -> None:
        await self.broker.connect()
        await self.broker.ping()

    def _report(self, exc: Exception, pause: float) -> None:
        if isinstance(exc, DatabaseError):
            log.warning("db.unavailable", extra={**self._log, "error": str(exc), "retry_in": pause})
        else:
            log.exception("processor.error", extra={**self._log, "retry_in": pause})

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
        """One cycle: claim, publish, mark. Returns the number of rows handled."""
        claim = await self.store.claim(
            self.target, self.outbox.batch_size, self.worker_id, self.outbox.lease_seconds
        )
        if not claim.rows:
            return 0
        # Until the outcomes are written, a cancellation (shutdown past its grace period)
        # gives these rows back: see _shutdown.
        self._claimed = claim
        try:
            marks = await self._deliver(claim.rows)
            await self._mark(claim.token, marks)
        finally:
            if not _cancelling():
                self._claimed = None
        self.stats.batches += 1
        return len(claim.rows)

    async def _idle_timeout(self, handled: int) -> float | None:
        """None to go on at once; otherwise how long to wait for a wake-up."""
        if handled >= self.outbox.batch_size:
            return None
        if self._check_due:
            self._next_due = await self.store.next_due(self.target)
            self._check_due = self._next_due is not None
            if self._next_due is not None:
                self._next_due += asyncio.get_running_loop().time()
        timeout = self.outbox.poll_interval
        if self._next_due is not None:
            remaining = self._next_due - asyncio.get_running_loop().time()
            if remaining <= 0:
                self._next_due = None
                return 0.0 if handled else 0.05
            timeout = min(timeout, remaining + 0.005)
        return timeout

    async def _deliver(self, rows: Sequence[ClaimedRow]) -> Marks:
        """Publish a batch in waves: the n-th row of every stream goes in wave n.

        A broker can fail one message and take the next; within one wave no two messages
        share a stream, so a failed row's successors are never sent behind its back: they
        stay untried (their attempt is not counted) and wait for it.
        """
        marks = Marks()
        held: set[str] = set()
        for wave in _waves(rows):
            sendable: list[tuple[ClaimedRow, OutgoingMessage]] = []
            for row in wave:
                if row.stream_key is not None and row.stream_key in held:
                    marks.untried.append(row.seq)
                    continue
                try:
                    wire = render(
                        row.envelope,
                        self.settings.profile,
                        sequence=row.seq,
                        omit=self.settings.omit,
                    )
                except EnvelopeError as exc:
                    marks.abandoned.append((row.seq, f"cannot render envelope: {exc}"))
                    continue
                sendable.append((row, OutgoingMessage(row.destination, wire)))
            if not sendable:
                continue
            results = await self._publish([message for _, message in sendable])
            for (row, _), result in zip(sendable, results, strict=True):
                if not self._classify(row, result, marks) and row.stream_key is not None:
                    held.add(row.stream_key)
        self._record(marks, rows)
        return marks

    async def _publish(self, messages: list[OutgoingMessage]) -> list[PublishResult]:
        settings = self.settings
        # publish() connects first when it has to, so both timeouts bound one call.
        limit = settings.connect_timeout + settings.publish_timeout + 1
        try:
            results = await asyncio.wait_for(self.broker.publish(messages), limit)
        except BrokerError as exc:  # unreachable, or unusable (e.g. its stream cannot be made)
            self.circuit.unreachable(str(exc))
            return await self._all_failed(messages, str(exc))
        except TimeoutError:
            error = f"{self.target}: broker did not answer within the timeout"
            self.circuit.unreachable(error)
            return await self._all_failed(messages, error)
        except Exception as exc:  # an adapter bug must not stop delivery to other targets
            log.exception("broker.error", extra=self._log)
            return await self._all_failed(messages, f"{type(exc).__name__}: {exc}")
        self.circuit.reachable()
        if len(results) != len(messages):
            return await self._all_failed(
                messages, f"adapter returned {len(results)} results for {len(messages)} messages"
            )
        return results

    async def _all_failed(self, messages: list[OutgoingMessage], error: str) -> list[PublishResult]:
        """The broker could not be used: drop the connection so the next batch reconnects."""
        log.warning("broker.unavailable", extra={**self._log, "error": error})
        self.stats.last_error = error
        await self._disconnect()
        return [PublishResult.failed(error, retryable=True) for _ in messages]

    def _classify(self, row: ClaimedRow, result: PublishResult, marks: Marks) -> bool:
        """Sort one outcome into ``marks``; False when the row will be retried (it then holds
        back its stream)."""
        if result.ok:
            marks.published.append(row.seq)
            return True
        error = result.error or "failed"
        if not result.retryable:
            marks.abandoned.append((row.seq, f"not retryable: {error}"))
        elif row.attempts >= self.outbox.retry.max_attempts:
            marks.abandoned.append((row.seq, f"gave up after {row.attempts} attempts: {error}"))
        else:
            delay = retry_delay(row.attempts, self.outbox.retry, self._rand)
            marks.failed.append((row.seq, delay, error))
            return False
        return True

    def _record(self, marks: Marks, rows: Sequence[ClaimedRow]) -> None:
        self.stats.published += len(marks.published)
        self.stats.failed += len(marks.failed)
        self.stats.abandoned += len(marks.abandoned)
        if marks.failed or marks.abandoned:
            self._check_due = True
            by_seq = {row.seq: row for row in rows}
            for seq, error in marks.abandoned:
                log.error(
                    "row.abandoned",
                    extra={
                        **self._log,
                        "message_id": by_seq[seq].message_id,
                        "attempts": by_seq[seq].attempts,
                        "error": error,
                    },
                )
            for seq, delay, error in marks.failed:
                log.debug(
                    "row.failed",
                    extra={
                        **self._log,
                        "message_id": by_seq[seq].message_id,
                        "attempts": by_seq[seq].attempts,
                        "retry_in": round(delay, 3),
                        "error": error,
                    },
                )
            first = marks.failed[0][2] if marks.failed else marks.abandoned[0][1]
            self.stats.last_error = first
            log.warning(
                "batch.failures",
                extra={
                    **self._log,
                    "failed": len(marks.failed),
                    "abandoned": len(marks.abandoned),
                    "published": len(marks.published),
                    "error": first,
                },
            )

    async def _mark(self, token: int, marks: Marks) -> None:
        """Write outcomes back, retrying while the lease lasts (marks are idempotent)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.outbox.lease_seconds * 0.8
        delay = 0.1
        while True:
            try:
                await self.store.mark(self.target, token, marks)
                return
            except DatabaseError as exc:
                if loop.time() + delay > deadline:
                    log.error(
                        "batch.mark_failed",
                        extra={**self._log, "rows": len(marks), "error": str(exc)},
                    )
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _disconnect(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.broker.close(), 5)

    async def _shutdown(self) -> None:
        """Give back rows claimed but not marked (cancelled mid-batch), then disconnect."""
        claimed, self._claimed = self._claimed, None
        if claimed is not None:
            with contextlib.suppress(Exception):
                seqs = [r.seq for r in claimed.rows]
                await asyncio.shield(self.store.release(self.target, claimed.token, seqs))
                log.info("batch.released", extra={**self._log, "rows": len(seqs)})
        await self._disconnect()


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _waves(rows: Sequence[ClaimedRow]) -> list[list[ClaimedRow]]:
    """Split a batch so that no wave holds two rows of one stream (order kept in each)."""
    waves: list[list[ClaimedRow]] = []
    depth: dict[str, int] = {}
    for row in rows:
        level = 0
        if row.stream_key is not None:
            level = depth.get(row.stream_key, 0)
            depth[row.stream_key] = level + 1
        if level == len(waves):
            waves.append([])
        waves[level].append(row)
    return waves
