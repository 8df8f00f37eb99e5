"""The chaos run's ledger, and the stream read back and checked against it.

The run (``tests.chaos.chaos``) writes the ledger: each committed id with its stream, sequence
number and commit time, the ids in flight at each disruption, and the windows in which a
database crash may have forgotten the router's bookkeeping, and the streams a poison event
stopped. ``check_stream`` then reads every message stored in the stream and fills the report:
lost, repeats (explained or not), order violations, and the time figures of
``tests.chaos.report`` (those of delay and stall over the streams that were not stopped).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import nats
from nats.js.api import DeliverPolicy

from tests.chaos.report import Report, delay_figures, longest_stall

__all__ = ["Ledger", "check_stream", "units_in_part"]


@dataclass
class Ledger:
    """What the producers committed and which ids were in flight at each disruption."""

    commits: dict[str, tuple[str, int, float]] = field(default_factory=dict)
    in_flight: set[str] = field(default_factory=set)
    graceful_in_flight: set[str] = field(default_factory=set)
    """Ids leased by a worker when it got SIGTERM: they explain no repeat."""
    crash_windows: list[tuple[float, float]] = field(default_factory=list)
    """(from, to) epoch seconds: the commit window before each database crash, to the end
    of its recovery."""
    stopped: set[str] = field(default_factory=set)
    """Streams with a poison event: the target's ordering stops them until an operator
    releases them, so their events' delays are the operator's, not the relay's."""
    units: dict[str, frozenset[str]] = field(default_factory=dict)
    """With ``atomic``: each committed id, with every id its transaction committed."""

    def explained(self, message_id: str, first_stored: float | None) -> bool:
        """A repeat is explained when its row was in flight at a disruption, or when its first
        copy reached the broker in the commit window of a database crash."""
        if message_id in self.in_flight:
            return True
        return first_stored is not None and any(
            start <= first_stored <= end for start, end in self.crash_windows
        )


@dataclass
class _Reading:
    """The stream as read so far, checked message by message."""

    ledger: Ledger
    report: Report
    seen: set[str] = field(default_factory=set)
    first_stored: dict[str, float] = field(default_factory=dict)
    highest: dict[str, int] = field(default_factory=dict)
    after_graceful: set[str] = field(default_factory=set)
    batches: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    """Atomic batches as stored: (stream sequence, message id) by ``Nats-Batch-Id``."""
    unbatched: list[str] = field(default_factory=list)
    """Ids of several-event transactions stored outside any batch."""

    def record(
        self,
        message_id: str,
        stored: datetime | None,
        data: bytes,
        sequence: int = 0,
        batch: str | None = None,
    ) -> None:
        """Count a repeat, or note a first copy: when it was stored, and its stream's order;
        every copy's batch (``Nats-Batch-Id``) and stream sequence."""
        if batch is not None:
            self.batches.setdefault(batch, []).append((sequence, message_id))
        elif len(self.ledger.units.get(message_id, ())) > 1:
            self.unbatched.append(message_id)
        if message_id in self.seen:
            self.report.duplicated += 1
            if not self.ledger.explained(message_id, self.first_stored.get(message_id)):
                self.report.unexplained_duplicates.append(message_id)
                if message_id in self.ledger.graceful_in_flight:
                    self.after_graceful.add(message_id)
            return
        self.seen.add(message_id)
        if stored is not None:
            self.first_stored[message_id] = stored.timestamp()
        tick = json.loads(data)["payload"]
        stream, n = tick["stream"], tick["n"]
        if n < self.highest.get(stream, 0):
            self.report.violations.append(f"{stream}: {n} after {self.highest[stream]}")
        self.highest[stream] = max(self.highest.get(stream, 0), n)


async def check_stream(
    url: str, stream: str, subjects: str, ledger: Ledger, report: Report, started_at: float
) -> None:
    """Read every message of ``stream`` back and fill ``report`` from it and ``ledger``;
    ``started_at`` (epoch seconds) is the 0 of the report's timeline."""
    read_at = time.time()  # what is still missing now waited until now
    reading = _Reading(ledger, report)
    client = await nats.connect(url)
    try:
        js = client.jetstream()
        total = (await js.stream_info(stream)).state.messages
        done = asyncio.Event()
        count = 0

        async def record(msg: Any) -> None:
            nonlocal count
            count += 1
            stored = msg.metadata.timestamp
            reading.record(
                msg.headers["Nats-Msg-Id"],
                stored if isinstance(stored, datetime) else None,
                msg.data,
                msg.metadata.sequence.stream,
                msg.headers.get("Nats-Batch-Id"),
            )
            if count >= total:
                done.set()

        subscription = await js.subscribe(
            subjects, cb=record, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL
        )
        if total:
            await asyncio.wait_for(done.wait(), 120)
        await subscription.unsubscribe()
    finally:
        await client.close()
    _sum_up(reading, read_at, started_at)


def units_in_part(
    units: dict[str, frozenset[str]],
    batches: dict[str, list[tuple[int, str]]],
    unbatched: list[str],
) -> list[str]:
    """The transactions (each named by its first id) some copy of which a consumer could see
    without the rest: in a batch (one or more whole transactions), a transaction not whole,
    or not at contiguous sequences; and a member of a transaction of several stored outside
    any batch."""
    found: dict[str, None] = {}
    for members in batches.values():
        by_unit: dict[frozenset[str], list[tuple[int, str]]] = {}
        for sequence, message_id in members:
            by_unit.setdefault(units.get(message_id, frozenset({message_id})), []).append(
                (sequence, message_id)
            )
        for unit, stored in by_unit.items():
            stored.sort()
            whole = unit == {message_id for _, message_id in stored} and len(unit) == len(stored)
            contiguous = stored[-1][0] - stored[0][0] == len(stored) - 1
            if not (whole and contiguous):
                found[min(unit)] = None
    found.update(dict.fromkeys(min(units[i]) for i in unbatched))
    return list(found)


def _sum_up(reading: _Reading, read_at: float, started_at: float) -> None:
    """The counts, and the time figures from commit and first-stored times."""
    report, commits_by_id = reading.report, reading.ledger.commits
    units = reading.ledger.units
    report.units = len({members for members in units.values() if len(members) > 1})
    in_part = units_in_part(units, reading.batches, reading.unbatched)
    report.units_in_part, report.units_in_part_ids = len(in_part), in_part[:20]
    lost = [i for i in commits_by_id if i not in reading.seen]
    report.delivered = len(reading.seen & set(commits_by_id))
    report.lost, report.lost_ids = len(lost), lost[:20]
    report.duplicates_not_in_flight = len(report.unexplained_duplicates)
    report.unexplained_duplicates = report.unexplained_duplicates[:20]
    report.duplicates_after_graceful_stop = len(reading.after_graceful)
    report.order_violations = len(report.violations)
    report.violations = report.violations[:20]
    # The stopped streams' events wait for the operator by design: figured apart.
    stopped = reading.ledger.stopped
    commits = {i: at for i, (stream, _, at) in commits_by_id.items() if stream not in stopped}
    waited = {i: at for i, (stream, _, at) in commits_by_id.items() if stream in stopped}
    first_stored = reading.first_stored
    report.set_delays(stored - commits[i] for i, stored in first_stored.items() if i in commits)
    report.stopped_events = len(waited)
    report.stopped_max_delay_seconds = delay_figures(
        stored - waited[i] for i, stored in first_stored.items() if i in waited
    ).max
    # Their deliveries still count as the relay delivering, and end a stall.
    stall = longest_stall(commits, first_stored, end=read_at)
    report.longest_stall_seconds = round(stall.seconds, 3)
    if stall.seconds:
        report.longest_stall_from_seconds = round(stall.start - started_at, 3)
