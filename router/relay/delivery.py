"""Delivering one claimed batch to one broker: render, publish in waves, classify outcomes.

The connection is the ``BrokerLink``'s: this module renders, splits into waves, and decides
what each answer means for its row. No database here: the processor claims rows, keeps their
lease (a ``KeepLease`` it hands in) and writes back the ``Marks`` this returns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from brokers import BrokerSettings, OutgoingMessage, PublishResult
from brokers import waves as _waves
from envelopes import DowncastError, EnvelopeError, HeaderName, WireMessage
from router.config import RetrySettings
from router.relay.link import BrokerLink
from router.relay.metrics import Metrics, observe_all
from router.relay.retry import retry_delay
from router.relay.stats import ProcessorStats
from router.relay.store import ClaimedRow, Marks
from router.relay.streams import RunStreams

__all__ = ["Delivery", "KeepLease", "Render", "unit_waves", "units_of", "waves"]

log = logging.getLogger(__name__)

KeepLease = Callable[[float], Awaitable[bool]]
"""Makes sure a batch's lease has at least so many seconds left; False when it cannot (the
processor's ``router.relay.lease.Lease.keep``)."""


class Render(Protocol):
    """Makes the wire message a target receives from a stored envelope (by default its
    ``BrokerSettings.render``; ``router.serve.runner`` gives ``router.write.pinning.Received``,
    which first downcasts for a pinned partner). Raises DowncastError or EnvelopeError."""

    def __call__(
        self, stored: str, *, sequence: int | None, skipped: Sequence[str] = ()
    ) -> WireMessage:
        """The wire message of one row (``skipped``: the gap before it in its stream)."""
        ...


class Delivery:
    """Publishes batches to one target's broker and decides what becomes of each row."""

    def __init__(
        self,
        *,
        target: str,
        settings: BrokerSettings,
        link: BrokerLink,
        retry: RetrySettings,
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
        self.link = link
        self.retry = retry
        self.stats = stats
        self._rand = rand
        self._log = labels
        self._metrics = metrics
        self._render: Render = settings.render if render is None else render
        self._stopping = stopping

    async def deliver(
        self,
        rows: Sequence[ClaimedRow],
        keep_lease: KeepLease | None = None,
        streams: RunStreams | None = None,
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

        Each row with a stream key names the gap before it (``ClaimedRow.skipped``, set here to
        what it carries): what its claim read, with the rows of its stream abandoned since,
        earlier in the run, and without those a row published since named. A published row's
        gap goes into ``Marks.reported``, to be deleted with the marks.

        ``streams``: what the earlier batches of the same transaction (PostgreSQL) left of
        their streams, which this batch's claim could not see: failures that hold streams
        back, gaps opened and closed (``RunStreams``); this batch's are added to it.

        A row refused for good, or out of attempts, is given up on as the target's
        ``ordering`` says (``_give_up``): abandoned (``skip``), or kept, held or parked, and
        then its stream is held back for the rest of the run as behind a failed row. A broker
        this host cannot reach gives no verdict: those rows go back untried in every mode.

        On a target with ``atomic`` the batch goes as units instead (``_deliver_units``).
        """
        streams = RunStreams() if streams is None else streams
        if self.settings.atomic:
            return await self._deliver_units(rows, keep_lease, streams)
        marks = Marks()
        held = streams.held
        split = waves(rows)
        for n, wave in enumerate(split):
            if not await self._may_send(keep_lease):
                marks.untried.extend(row.seq for rest in split[n:] for row in rest)
                break
            sendable = self._sendable(wave, streams, marks)
            if not sendable:
                continue
            on_trial = self.link.on_trial
            results = await self.link.publish([message for _, message in sendable])
            unanswered = None
            for (row, _), result in zip(sendable, results, strict=True):
                if result.unreachable:
                    unanswered = unanswered or result.error or "no answer"
                    if not on_trial:  # no verdict on the row: another host may send it
                        marks.untried.append(row.seq)
                        if row.stream_key is not None:
                            held.add(row.stream_key)
                        continue
                if not self._classify(row, result, marks, streams) and row.stream_key is not None:
                    held.add(row.stream_key)
            if unanswered is None:
                self.link.answered()
                continue
            # This host cannot reach the broker: nothing more from this batch, and no claim
            # until a probe gets through.
            self.link.cut_off(unanswered)
            marks.untried.extend(row.seq for rest in split[n + 1 :] for row in rest)
            break
        self._record(marks, rows)
        return marks

    async def _may_send(self, keep_lease: KeepLease | None) -> bool:
        """Whether the next wave may go: not when stopping, or when another batch found the
        broker unreachable meanwhile, or when the lease cannot be kept for a publish
        (``publish_limit``) and a second more, for rendering and marking."""
        if self._stopping() or self.link.is_open:
            return False
        return keep_lease is None or await keep_lease(self.settings.publish_limit + 1)

    async def _deliver_units(
        self, rows: Sequence[ClaimedRow], keep_lease: KeepLease | None, streams: RunStreams
    ) -> Marks:
        """``deliver`` for a target with ``atomic``: each unit (the rows one application
        transaction staged for the target, ``ClaimedRow.unit``) is one atomic write, all its
        members stored or none, with one verdict for all of them.

        Units go in the order their transactions committed on each stream (their last rows'
        order: a transaction staging on a stream after another waited for that one's commit,
        so all its rows come later), in waves where no two units share a stream
        (``unit_waves``). A unit the claim could not take whole, or with a member whose
        stream is held back, stays untried, and holds back its streams for the rest of the
        run: a later unit never overtakes it. A member that cannot be rendered gives its
        whole unit its verdict, naming it."""
        marks = Marks()
        held = streams.held
        split = unit_waves(units_of(rows))
        for n, wave in enumerate(split):
            if not await self._may_send(keep_lease):
                marks.untried.extend(row.seq for later in split[n:] for u in later for row in u)
                break
            sendable: list[tuple[list[ClaimedRow], list[OutgoingMessage]]] = []
            for unit in wave:
                keys = _keys(unit)
                if not all(row.whole for row in unit) or not held.isdisjoint(keys):
                    marks.untried.extend(row.seq for row in unit)
                    held.update(keys)
                    continue
                messages = self._render_unit(unit, streams, marks)
                if messages is not None:
                    sendable.append((unit, messages))
            if not sendable:
                continue
            on_trial = self.link.on_trial
            verdicts = await self.link.publish_atomic([messages for _, messages in sendable])
            unanswered = None
            for (unit, _), results in zip(sendable, verdicts, strict=True):
                cut = next((r for r in results if r.unreachable), None)
                if cut is not None:
                    unanswered = unanswered or cut.error or "no answer"
                    if not on_trial:  # no verdict on the unit: another host may send it
                        marks.untried.extend(row.seq for row in unit)
                        held.update(_keys(unit))
                        continue
                self._judge_unit(unit, results, marks, streams)
            if unanswered is None:
                self.link.answered()
                continue
            self.link.cut_off(unanswered)
            marks.untried.extend(row.seq for later in split[n + 1 :] for u in later for row in u)
            break
        self._record(marks, rows)
        return marks

    def _render_unit(
        self, unit: list[ClaimedRow], streams: RunStreams, marks: Marks
    ) -> list[OutgoingMessage] | None:
        """The unit's messages, each member with the gap before it and the transaction's
        headers (``HeaderName.TRANSACTION_ID``, ``TRANSACTION_SIZE``); None when a member
        cannot be rendered (the unit's verdict is then in ``marks``)."""
        messages = []
        for position, row in enumerate(unit, 1):
            row.skipped = streams.skipped(row.stream_key, row.seq, row.skipped)
            try:
                wire = self._render(row.envelope, sequence=row.seq, skipped=row.skipped)
            except (DowncastError, EnvelopeError) as exc:
                retryable = isinstance(exc, DowncastError)  # the user's downcaster may change
                what = "cannot downcast" if retryable else "cannot render envelope"
                error = (
                    f"atomic unit of {len(unit)} refused: member {position} ({row.message_id}) "
                    f"{what}: {exc}"
                )
                verdict = PublishResult.failed(error, retryable=retryable)
                self._judge_unit(unit, [verdict] * len(unit), marks, streams)
                return None
            # The transaction's bounds, for its consumers, whatever the broker's unit holds.
            wire.headers[HeaderName.TRANSACTION_ID] = unit[0].message_id
            wire.headers[HeaderName.TRANSACTION_SIZE] = str(len(unit))
            messages.append(OutgoingMessage(row.destination, wire))
        return messages

    def _judge_unit(
        self,
        unit: list[ClaimedRow],
        results: Sequence[PublishResult],
        marks: Marks,
        streams: RunStreams,
    ) -> None:
        """Sort a unit's outcome into ``marks``: stored, each member with its receipt; else
        one verdict for every member, a retry with one delay for all (so the unit falls due
        as one), or given up on as ``ordering`` says. The streams of a unit that stays hold
        back the rest of the run."""
        if any(result.ok for result in results):  # stored (a broker's partial apply: as it says)
            for row, result in zip(unit, results, strict=True):
                if not self._classify(row, result, marks, streams) and row.stream_key is not None:
                    streams.held.add(row.stream_key)
            return
        first = results[0]
        error = first.error or "failed"
        attempts = max(row.attempts for row in unit)
        if first.retryable and attempts < self.retry.max_attempts:
            delay = retry_delay(attempts, self.retry, self._rand)
            marks.failed.extend((row.seq, delay, error) for row in unit)
            streams.held.update(_keys(unit))
            return
        reason = (
            f"not retryable: {error}"
            if not first.retryable
            else f"gave up after {attempts} attempts: {error}"
        )
        for row in unit:
            if not self._give_up(row, reason, marks, streams) and row.stream_key is not None:
                streams.held.add(row.stream_key)

    def _sendable(
        self, wave: Sequence[ClaimedRow], streams: RunStreams, marks: Marks
    ) -> list[tuple[ClaimedRow, OutgoingMessage]]:
        """The wave's rows, rendered, each with the gap before it. A row behind a failed one
        of its stream (``streams.held``) stays untried; one that cannot be downcast or
        rendered has its outcome in ``marks`` now."""
        sendable: list[tuple[ClaimedRow, OutgoingMessage]] = []
        held = streams.held
        for row in wave:
            key = row.stream_key
            if key is not None and key in held:
                marks.untried.append(row.seq)
                continue
            row.skipped = streams.skipped(key, row.seq, row.skipped)
            try:
                wire = self._render(row.envelope, sequence=row.seq, skipped=row.skipped)
            except DowncastError as exc:  # the user's downcaster: this row alone retries
                failed = PublishResult.failed(f"cannot downcast: {exc}", retryable=True)
                if not self._classify(row, failed, marks, streams) and key is not None:
                    held.add(key)
                continue
            except EnvelopeError as exc:
                error = f"cannot render envelope: {exc}"
                if not self._give_up(row, error, marks, streams) and key is not None:
                    held.add(key)
                continue
            sendable.append((row, OutgoingMessage(row.destination, wire)))
        return sendable

    def _classify(
        self, row: ClaimedRow, result: PublishResult, marks: Marks, streams: RunStreams
    ) -> bool:
        """Sort one outcome into ``marks`` (and the gaps it opens or closes into ``streams``);
        False when the row will be retried (it then holds back its stream)."""
        if result.ok:
            marks.published.append(row.seq)
            if result.receipt is not None:
                marks.receipts[row.seq] = result.receipt
            if row.skipped and row.stream_key is not None:  # its consumer knows of the gap now
                marks.reported.extend((row.stream_key, mid) for mid in row.skipped)
                streams.published(row.stream_key, row.skipped)
            return True
        error = result.error or "failed"
        if not result.retryable:
            return self._give_up(row, f"not retryable: {error}", marks, streams)
        if row.attempts >= self.retry.max_attempts:
            reason = f"gave up after {row.attempts} attempts: {error}"
            return self._give_up(row, reason, marks, streams)
        delay = retry_delay(row.attempts, self.retry, self._rand)
        marks.failed.append((row.seq, delay, error))
        return False

    def _give_up(self, row: ClaimedRow, error: str, marks: Marks, streams: RunStreams) -> bool:
        """A row refused for good (or out of attempts), as the target's ``ordering`` says:
        ``skip`` abandons it and opens a gap in its stream (True: the stream goes on);
        ``hold`` keeps it, ``held``, and ``park`` parks it with the rest of its stream (False:
        the stream waits, as behind a failed row). A row without a stream key has no stream to
        keep in order: it is abandoned whatever the mode."""
        ordering, key = self.settings.ordering, row.stream_key
        if key is None or ordering == "skip":
            marks.abandoned.append((row.seq, error))
            streams.abandoned(key, row.seq, row.message_id)
            return True
        if ordering == "hold":
            marks.held.append((row.seq, error))
        else:
            marks.parked.append((row.seq, key, error))
        return False

    def _record(self, marks: Marks, rows: Sequence[ClaimedRow]) -> None:
        self.stats.published += len(marks.published)
        self.stats.failed += len(marks.failed)
        self.stats.abandoned += len(marks.abandoned)
        by_seq = {row.seq: row for row in rows}
        if self._metrics is not None:
            self._measure(marks, by_seq)
        parked = [(seq, error) for seq, _, error in marks.parked]
        kept = [*marks.held, *parked]  # their streams wait for an operator
        if not (marks.failed or marks.abandoned or kept):
            return
        given_up = (
            ("row.abandoned", marks.abandoned),
            ("row.held", marks.held),
            ("row.parked", parked),
        )
        for event, outcomes in given_up:
            for seq, error in outcomes:
                row = by_seq[seq]
                log.error(
                    event,
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
        first = marks.failed[0][2] if marks.failed else [*marks.abandoned, *kept][0][1]
        self.stats.last_error = first
        log.warning(
            "batch.failures",
            extra={
                **self._log,
                "failed": len(marks.failed),
                "abandoned": len(marks.abandoned),
                "set_aside": len(kept),
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
            *(s for s, _ in marks.held),
            *(s for s, _, _ in marks.parked),
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


def waves(rows: Sequence[ClaimedRow]) -> list[list[ClaimedRow]]:
    """Split a batch so that no wave holds two rows of one stream (order kept in each)."""
    return _waves(rows, _stream_of)


def _stream_of(row: ClaimedRow) -> str | None:
    return row.stream_key


def units_of(rows: Sequence[ClaimedRow]) -> list[list[ClaimedRow]]:
    """A batch's units (``ClaimedRow.unit``), each in outbox order, in the order their
    transactions committed on any stream they share: by their last rows. A row without a
    unit is one of its own."""
    units: dict[int | tuple[int], list[ClaimedRow]] = {}
    for row in rows:
        units.setdefault(row.unit if row.unit is not None else (row.seq,), []).append(row)
    ordered = [sorted(unit, key=lambda r: r.seq) for unit in units.values()]
    return sorted(ordered, key=lambda unit: unit[-1].seq)


def unit_waves(units: Sequence[list[ClaimedRow]]) -> list[list[list[ClaimedRow]]]:
    """Split units so that no wave holds two units sharing a stream, each unit in a later wave
    than every unit before it on any of its streams (``units`` in commit order)."""
    split: list[list[list[ClaimedRow]]] = []
    last: dict[str, int] = {}
    for unit in units:
        keys = _keys(unit)
        n = max((last[key] + 1 for key in keys if key in last), default=0)
        for key in keys:
            last[key] = n
        while len(split) <= n:
            split.append([])
        split[n].append(unit)
    return split


def _keys(unit: Sequence[ClaimedRow]) -> set[str]:
    return {row.stream_key for row in unit if row.stream_key is not None}
