"""Delivering one claimed batch to one broker: render, publish in waves, classify outcomes.

No database here: the processor claims rows, keeps their lease (a ``KeepLease`` it hands in)
and writes back the ``Marks`` this returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from brokers import Broker, BrokerSettings, OutgoingMessage, PublishResult
from brokers import waves as _waves
from envelopes import BrokerError, DowncastError, EnvelopeError, WireMessage
from router.config import RetrySettings
from router.relay.circuit import Circuit
from router.relay.metrics import Metrics, observe_all
from router.relay.retry import retry_delay
from router.relay.silence import AnswerTime
from router.relay.stats import ProcessorStats
from router.relay.store import ClaimedRow, Marks

__all__ = ["Delivery", "KeepLease", "Render", "waves"]

log = logging.getLogger(__name__)

KeepLease = Callable[[float], Awaitable[bool]]
"""Makes sure a batch's lease has at least so many seconds left; False when it cannot (the
processor's ``router.relay.lease.Lease.keep``)."""


class Render(Protocol):
    """Makes the wire message a target receives from a stored envelope (by default its
    ``BrokerSettings.render``; ``router.serve.runner`` gives ``router.write.pinning.Received``,
    which first downcasts for a pinned partner). Raises DowncastError or EnvelopeError."""

    def __call__(self, stored: str, *, sequence: int | None) -> WireMessage:
        """The wire message of one row."""
        ...


class Delivery:
    """Publishes batches to one target's broker and decides what becomes of each row."""

    def __init__(
        self,
        *,
        target: str,
        settings: BrokerSettings,
        broker: Broker,
        retry: RetrySettings,
        circuit: Circuit,
        stats: ProcessorStats,
        rand: Callable[[], float],
        labels: dict[str, str],
        metrics: Metrics | None = None,
        render: Render | None = None,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        """``render`` makes each row's wire message (default: ``settings.render``); when it
        cannot downcast a row for a pinned partner, that row fails and retries alone. Once
        ``stopping()`` is true, no further wave starts (a graceful stop)."""
        self.target = target
        self.settings = settings
        self.broker = broker
        self.retry = retry
        self.circuit = circuit
        self.stats = stats
        self._rand = rand
        self._log = labels
        self._metrics = metrics
        self._render: Render = settings.render if render is None else render
        self._stopping = stopping
        # A publish went unanswered on the current connection: the probe replaces it. (Not
        # closed at once: closing a silent connection can itself hang, and the batch's rows
        # must go back first.)
        self._suspect = False
        # How long publishes take, and how long pings do: apart, since a ping can cost far
        # more than a publish (a Service Bus ping attaches a link and puts a token: ~0.5 s
        # where a publish takes 15 ms), and a healthy broker must not be found silent because
        # its ping took longer than its publishes do.
        self._answer = AnswerTime(settings.silence_timeout, settings.publish_timeout)
        self._pings = AnswerTime(settings.silence_timeout, settings.publish_timeout)
        self._timing: asyncio.Future[None] | None = None  # the ping timing a new connection

    async def deliver(
        self,
        rows: Sequence[ClaimedRow],
        keep_lease: KeepLease | None = None,
        held: set[str] | None = None,
    ) -> Marks:
        """Publish a batch in waves: the n-th row of every stream goes in wave n.

        A broker can fail one message and take the next; within one wave no two messages
        share a stream, so a failed row's successors are never sent behind its back: they
        stay untried (their attempt is not counted) and wait for it.

        Before each wave, ``keep_lease`` is asked for time enough to publish it and mark the
        batch. When the lease cannot be kept, no further wave is sent (another worker may
        hold its rows, and would send them too): the rest of the batch stays untried.

        When the processor is stopping, the wave being published is finished and no other
        starts: the rest stays untried, and is given back with the marks at once rather than
        held until the grace period ends (and sent again by whoever claims it next).

        ``held``: streams already held back by a failure in an earlier batch of the same
        transaction (PostgreSQL); the streams this batch holds back are added to it.
        """
        marks = Marks()
        held = set() if held is None else held
        split = waves(rows)
        for n, wave in enumerate(split):
            # Stopping, or another batch found the broker unreachable meanwhile: give the rest
            # back untried.
            if self._stopping() or self.circuit.is_open:
                marks.untried.extend(row.seq for rest in split[n:] for row in rest)
                break
            # publish_limit bounds the wave's publish; the second is for rendering and marking.
            if keep_lease is not None and not await keep_lease(self.settings.publish_limit + 1):
                marks.untried.extend(row.seq for rest in split[n:] for row in rest)
                break
            sendable = self._sendable(wave, held, marks)
            if not sendable:
                continue
            on_trial = self.circuit.trial
            results = await self._publish([message for _, message in sendable])
            unanswered = None
            for (row, _), result in zip(sendable, results, strict=True):
                if result.unreachable:
                    unanswered = unanswered or result.error or "no answer"
                    if not on_trial:  # no verdict on the row: another host may send it
                        marks.untried.append(row.seq)
                        if row.stream_key is not None:
                            held.add(row.stream_key)
                        continue
                if not self._classify(row, result, marks) and row.stream_key is not None:
                    held.add(row.stream_key)
            if unanswered is None:
                self.circuit.reachable()
                continue
            # This host cannot reach the broker: nothing more from this batch, and no claim
            # until a probe gets through.
            self.circuit.cut_off(unanswered)
            marks.untried.extend(row.seq for rest in split[n + 1 :] for row in rest)
            break
        self._record(marks, rows)
        return marks

    async def probe(self) -> None:
        """A fresh connection and a round trip (raises BrokerError or TimeoutError)."""
        if self._suspect:  # the connection that went silent: never trust it again
            await self.disconnect()
            self._suspect = False
        limit = self.settings.connect_timeout * 2 + 1
        async with asyncio.timeout(limit):
            await self.broker.connect()
            pinged = time.monotonic()
            await self.broker.ping()
        self._pinged(time.monotonic() - pinged)

    async def disconnect(self) -> None:
        """Drop the connection; the next publish connects again."""
        self._answer.reconnected()
        self._pings.reconnected()
        if self._timing is not None:
            self._timing.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.broker.close(), 5)

    def _sendable(
        self, wave: Sequence[ClaimedRow], held: set[str], marks: Marks
    ) -> list[tuple[ClaimedRow, OutgoingMessage]]:
        """The wave's rows, rendered. A row behind a failed one of its stream (``held``) stays
        untried; one that cannot be downcast or rendered has its outcome in ``marks`` now."""
        sendable: list[tuple[ClaimedRow, OutgoingMessage]] = []
        for row in wave:
            if row.stream_key is not None and row.stream_key in held:
                marks.untried.append(row.seq)
                continue
            try:
                wire = self._render(row.envelope, sequence=row.seq)
            except DowncastError as exc:  # the user's downcaster: this row alone retries
                failed = PublishResult.failed(f"cannot downcast: {exc}", retryable=True)
                if not self._classify(row, failed, marks) and row.stream_key is not None:
                    held.add(row.stream_key)
                continue
            except EnvelopeError as exc:
                marks.abandoned.append((row.seq, f"cannot render envelope: {exc}"))
                continue
            sendable.append((row, OutgoingMessage(row.destination, wire)))
        return sendable

    async def _publish(self, messages: list[OutgoingMessage]) -> list[PublishResult]:
        started = time.perf_counter()
        try:
            results = await self._watched(messages)
            if self._metrics is not None:  # one wave: from the first send to the last ack
                self._metrics.publish.labels(self._log["database"], self.target).observe(
                    time.perf_counter() - started
                )
        except BrokerError as exc:  # unreachable, or unusable (e.g. its stream cannot be made)
            return self._cut_off(messages, str(exc))
        except TimeoutError:
            return self._cut_off(messages, f"{self.target}: no answer within publish_timeout")
        except _Silent as exc:
            return self._cut_off(messages, str(exc))
        except Exception as exc:  # an adapter bug must not stop delivery to other targets
            log.exception("broker.error", extra=self._log)
            error = f"{type(exc).__name__}: {exc}"
            self.stats.last_error = error
            await self.disconnect()
            return [PublishResult.failed(error, retryable=True) for _ in messages]
        if len(results) != len(messages):
            error = f"adapter returned {len(results)} results for {len(messages)} messages"
            return [PublishResult.failed(error, retryable=True) for _ in messages]
        if any(r.unreachable for r in results):
            self._suspect = True
        return results

    async def _watched(self, messages: list[OutgoingMessage]) -> list[PublishResult]:
        """The publish's results, within ``publish_limit``.

        Once the broker's answer time is known (``router.relay.silence``), a publish still
        unanswered after its limit has the connection asked for a round trip (``ping``);
        when that is not answered within the pings' own limit, the path is silent
        (``_Silent``). So a host cut off from its broker knows within the two limits (half a
        second on a quick broker), instead of holding its batch, and on PostgreSQL the
        target, for the whole publish timeout; a broker that answers the ping but
        acknowledges slowly gets the publish timeout.
        """
        answer = self._answer
        silence = answer.limit
        patience = self._pings.limit
        started = time.monotonic()
        publish = asyncio.ensure_future(self.broker.publish(messages))
        ping: asyncio.Future[None] | None = None
        try:
            if answer.known:
                done, _ = await asyncio.wait({publish}, timeout=silence)
                if not done:
                    pinged = time.monotonic()
                    ping = asyncio.ensure_future(self.broker.ping())
                    await asyncio.wait(
                        {publish, ping}, timeout=patience, return_when=asyncio.FIRST_COMPLETED
                    )
                    if ping.done() and ping.exception() is None:
                        self._pings.observe(time.monotonic() - pinged)
                    elif not publish.done():
                        raise _Silent(
                            f"{self.target}: no answer within {silence:.2g} s, nor to a ping "
                            f"within {patience:.2g} s: the path to the broker is silent"
                        )
            left = self.settings.publish_limit - (time.monotonic() - started)
            results = await asyncio.wait_for(asyncio.shield(publish), max(left, 0.0))
        finally:
            # Not awaited: a client stuck on a silent socket may take its time to unwind,
            # and the batch's rows must go back now.
            for task in (publish, ping):
                if task is not None and not task.done():
                    task.cancel()
                    task.add_done_callback(_retrieve)
        if any(r.unreachable for r in results):
            return results
        if answer.known:
            answer.observe(time.monotonic() - started)
        elif self._timing is None or self._timing.done():
            # The first publish on this connection: time a round trip instead, beside the
            # batches (they are not watched until it is known).
            self._timing = asyncio.ensure_future(self._time_ping())
        return results

    async def _time_ping(self) -> None:
        """Measure one ping on the current connection (``router.relay.silence``)."""
        pinged = time.monotonic()
        try:
            await asyncio.wait_for(self.broker.ping(), self.settings.connect_timeout)
        except Exception:  # the next publish will tell
            return
        self._pinged(time.monotonic() - pinged)

    def _pinged(self, seconds: float) -> None:
        """A ping on a new connection answered: it times the pings, and is the publishes'
        first estimate until they are timed themselves."""
        self._pings.observe(seconds)
        if not self._answer.known:
            self._answer.observe(seconds)

    def _cut_off(self, messages: list[OutgoingMessage], error: str) -> list[PublishResult]:
        """This host could not use the broker: no verdict on any message. The connection is
        replaced by the next probe."""
        log.warning("broker.unavailable", extra={**self._log, "error": error})
        self.stats.last_error = error
        self._suspect = True
        return [PublishResult.cut_off(error) for _ in messages]

    def _classify(self, row: ClaimedRow, result: PublishResult, marks: Marks) -> bool:
        """Sort one outcome into ``marks``; False when the row will be retried (it then holds
        back its stream)."""
        if result.ok:
            marks.published.append(row.seq)
            if result.receipt is not None:
                marks.receipts[row.seq] = result.receipt
            return True
        error = result.error or "failed"
        if not result.retryable:
            marks.abandoned.append((row.seq, f"not retryable: {error}"))
        elif row.attempts >= self.retry.max_attempts:
            marks.abandoned.append((row.seq, f"gave up after {row.attempts} attempts: {error}"))
        else:
            delay = retry_delay(row.attempts, self.retry, self._rand)
            marks.failed.append((row.seq, delay, error))
            return False
        return True

    def _record(self, marks: Marks, rows: Sequence[ClaimedRow]) -> None:
        self.stats.published += len(marks.published)
        self.stats.failed += len(marks.failed)
        self.stats.abandoned += len(marks.abandoned)
        by_seq = {row.seq: row for row in rows}
        if self._metrics is not None:
            self._measure(marks, by_seq)
        if not (marks.failed or marks.abandoned):
            return
        for seq, error in marks.abandoned:
            row = by_seq[seq]
            log.error(
                "row.abandoned",
                extra={
                    **self._log,
                    "message_id": row.message_id,
                    "attempts": row.attempts,
                    "error": error,
                },
            )
        for seq, delay, error in marks.failed:
            row = by_seq[seq]
            log.debug(
                "row.failed",
                extra={
                    **self._log,
                    "message_id": row.message_id,
                    "attempts": row.attempts,
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

    def _measure(self, marks: Marks, by_seq: dict[int, ClaimedRow]) -> None:
        assert self._metrics is not None
        labels = (self._log["database"], self.target)
        metrics = self._metrics
        metrics.published.labels(*labels).inc(len(marks.published))
        metrics.failed.labels(*labels).inc(len(marks.failed))
        metrics.abandoned.labels(*labels).inc(len(marks.abandoned))
        tried = [
            *marks.published,
            *(s for s, _, _ in marks.failed),
            *(s for s, _ in marks.abandoned),
        ]
        metrics.retried.labels(*labels).inc(sum(1 for s in tried if by_seq[s].attempts > 1))
        now = time.time()
        latencies = []
        for seq in marks.published:
            created = by_seq[seq].created_at
            if created is not None:
                latencies.append(max(0.0, now - created))
        observe_all(metrics.latency.labels(*labels), latencies)
        slo = self.settings.slo_seconds
        metrics.within_slo.labels(*labels).inc(sum(1 for latency in latencies if latency <= slo))


class _Silent(Exception):
    """A publish and a ping went unanswered: the path to the broker is silent."""


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Consume an abandoned task's outcome (so that asyncio does not log it as never read)."""
    if not task.cancelled():
        task.exception()


def waves(rows: Sequence[ClaimedRow]) -> list[list[ClaimedRow]]:
    """Split a batch so that no wave holds two rows of one stream (order kept in each)."""
    return _waves(rows, _stream_of)


def _stream_of(row: ClaimedRow) -> str | None:
    return row.stream_key
