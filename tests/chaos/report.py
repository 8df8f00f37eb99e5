"""What a chaos run found, and the time figures computed from its ledger and the router's log.

Kept apart from the run (``tests.chaos.chaos``) so that each computation is a small function
of plain data that ``test_report.py`` checks on hand-made timelines, without any service:

- ``percentile`` and ``delay_figures``: p50, p99 and max of the commit-to-publish delays;
- ``longest_stall``: the longest stretch during which an event was waiting and none arrived;
- ``worker_starts``: the parent's ``worker.started`` / ``worker.ready`` JSON log lines;
- ``wakeup_changes`` and ``cuts_recovered``: the workers' ``wakeup.active`` /
  ``wakeup.fallback`` lines, and whether each cut of the log they follow shows in them;
- ``Report``: every figure, its table and its JSON.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

__all__ = [
    "DelayFigures",
    "Report",
    "Stall",
    "WakeupChange",
    "WorkerStarts",
    "cuts_recovered",
    "delay_figures",
    "disruptions_near",
    "longest_stall",
    "percentile",
    "wakeup_changes",
    "worker_starts",
]

# After the run cut the log connections: how soon each must have logged its fallback, and
# how soon its follower must be back (MariaDB's tries again after 1 s, PostgreSQL's at 0.5 s).
FALLBACK_WITHIN = 2.0
BACK_WITHIN = 10.0


def percentile(ordered: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of ascending ``ordered``; 0.0 if empty."""
    if not ordered:
        return 0.0
    # Nearest rank: a value that was measured, never an interpolation between two.
    rank = math.ceil(q * len(ordered))
    return ordered[min(max(rank, 1), len(ordered)) - 1]


class DelayFigures(NamedTuple):
    """p50, p99 and max of a set of delays, in seconds."""

    p50: float
    p99: float
    max: float


def delay_figures(delays: Iterable[float]) -> DelayFigures:
    """The figures of ``delays``; a negative one (clocks a hair apart) counts as 0."""
    ordered = sorted(max(0.0, d) for d in delays)
    if not ordered:
        return DelayFigures(0.0, 0.0, 0.0)
    return DelayFigures(percentile(ordered, 0.5), percentile(ordered, 0.99), ordered[-1])


class Stall(NamedTuple):
    """The longest stall: how long, and when it began (the same clock as its inputs)."""

    seconds: float
    start: float


def longest_stall(
    commits: Mapping[str, float], delivered: Mapping[str, float], end: float | None = None
) -> Stall:
    """The longest stretch during which some committed event was not delivered yet and no
    event was delivered at all.

    ``commits`` maps an id to its commit time, ``delivered`` an id to the time its first copy
    was stored (ids never committed there still count as deliveries). An id never delivered
    waits until ``end``; without ``end`` its wait after the last delivery is not counted.
    """
    timeline: list[tuple[float, int, str]] = []
    for message_id, committed in commits.items():
        stored = delivered.get(message_id)
        # The commit is timed after COMMIT returned, so the router may store it a hair
        # earlier: it was committed by then.
        timeline.append((committed if stored is None else min(committed, stored), 0, message_id))
    timeline += [(stored, 1, message_id) for message_id, stored in delivered.items()]
    # At the same instant, commits first: a stretch of length 0 either way.
    timeline.sort()
    longest = Stall(0.0, 0.0)
    waiting = 0
    since: float | None = None  # when the current stall began; None while nothing waits
    for at, kind, message_id in timeline:
        if kind == 0:
            waiting += 1
            since = at if since is None else since
            continue
        if since is not None and at - since > longest.seconds:
            longest = Stall(at - since, since)
        if message_id in commits:
            waiting -= 1
        since = at if waiting else None
    if since is not None and end is not None and end - since > longest.seconds:
        longest = Stall(end - since, since)
    return longest


def disruptions_near(
    disruptions: Iterable[tuple[float, str]], start: float, end: float, lead: float = 1.0
) -> list[tuple[float, str]]:
    """The disruptions from ``lead`` seconds before ``start`` to ``end``: a stall begins at
    the last delivery before it, which is often a moment before the disruption that caused it.
    """
    return [(at, what) for at, what in disruptions if start - lead <= at <= end]


@dataclass
class WorkerStarts:
    """The worker starts the router's parent logged: spawn-to-ready seconds per pid."""

    started: list[int] = field(default_factory=list)
    ready: dict[int, float] = field(default_factory=dict)

    @property
    def never_ready(self) -> list[int]:
        """Pids started that never logged ready (killed or stopped first, or stuck)."""
        return [pid for pid in self.started if pid not in self.ready]


def json_records(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The JSON objects among log lines; other lines (text, a worker's traceback) are
    skipped."""
    for line in lines:
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            yield record


def worker_starts(lines: Iterable[str]) -> WorkerStarts:
    """Read ``worker.started`` and ``worker.ready`` from JSON log lines; other lines (text,
    a worker's traceback) are skipped."""
    starts = WorkerStarts()
    for record in json_records(lines):
        event, pid = record.get("event"), record.get("pid")
        if not isinstance(pid, int):
            continue
        if event == "worker.started":
            starts.started.append(pid)
        elif event == "worker.ready" and isinstance(record.get("seconds"), int | float):
            starts.ready[pid] = float(record["seconds"])
    return starts


class WakeupChange(NamedTuple):
    """One ``wakeup.active`` or ``wakeup.fallback`` line of the router's log."""

    at: float
    """When it was logged, in seconds since the epoch."""
    event: str
    mechanism: str
    """'log', or the fallback's ('notify' on PostgreSQL, 'poll' on MariaDB), ..."""


def wakeup_changes(lines: Iterable[str]) -> list[WakeupChange]:
    """The wake-up changes the relay logged, from JSON log lines; other lines are skipped."""
    changes = []
    for record in json_records(lines):
        if record.get("event") not in ("wakeup.active", "wakeup.fallback"):
            continue
        at = datetime.fromisoformat(record["time"]).timestamp()
        changes.append(WakeupChange(at, record["event"], str(record.get("mechanism"))))
    return changes


def cuts_recovered(cuts: Iterable[tuple[float, int]], changes: Sequence[WakeupChange]) -> int:
    """How many of ``cuts`` ((when, connections cut), the clock of ``changes``) the log shows
    handled: a fallback per connection within FALLBACK_WITHIN, then as many log sessions
    started within BACK_WITHIN."""
    recovered = 0
    for at, connections in cuts:
        after = [(c.at - at, c) for c in changes if c.at >= at]
        fell_back = [c for d, c in after if c.event == "wakeup.fallback" and d <= FALLBACK_WITHIN]
        back = [c for d, c in after if _follows_log(c) and d <= BACK_WITHIN]
        recovered += len(fell_back) >= connections and len(back) >= connections
    return recovered


def _follows_log(change: WakeupChange) -> bool:
    return change.event == "wakeup.active" and change.mechanism == "log"


@dataclass
class Report:
    """What the run found; every figure a user of the router would care about."""

    size: str
    events_target: int
    streams: int
    database: str = "postgresql"
    seed: int = 0
    committed: int = 0
    delivered: int = 0
    lost: int = 0
    duplicated: int = 0
    duplicates_not_in_flight: int = 0
    order_violations: int = 0
    p50_delay_seconds: float = 0.0
    p99_delay_seconds: float = 0.0
    max_delay_seconds: float = 0.0
    longest_stall_seconds: float = 0.0
    longest_stall_from_seconds: float = 0.0
    """When the longest stall began, in seconds since the producers started."""
    worker_kills: int = 0
    graceful_stops: int = 0
    duplicates_after_graceful_stop: int = 0
    broker_restarts: int = 0
    broker_stop: str = "SIGTERM"
    partitions: int = 0
    """Times the router's path to the broker went silent (connections open)."""
    database_restarts: int = 0
    wakeup: str = "auto"
    """The database's ``wakeup:`` setting."""
    ordering: str = "skip"
    """The broker's ``ordering:`` setting."""
    poison: int = 0
    """Events padded past the stream's ``max_msg_size``, each on a stream of its own: refused
    for good until the run, as an operator, raises the limit and releases their keys."""
    keys_stopped: int = 0
    """The most stream keys ``router held`` listed at once on the target."""
    stopped_as: list[str] = field(default_factory=list)
    """The statuses of their heads, as listed: ``held`` or ``parked``."""
    rows_behind: int = 0
    """The most rows ``router held`` counted waiting behind those heads at once."""
    releases: int = 0
    """``router release`` runs that let a key go."""
    hold_to_release_seconds: float = 0.0
    """From the first head given up on (its ``since``) to the last release done."""
    stopped_events: int = 0
    """Committed events of the poisoned streams: they wait for the operator by design, so the
    delay and stall figures leave them out."""
    stopped_max_delay_seconds: float = 0.0
    """The longest commit-to-publish delay among those events: mostly the operator's wait."""
    atomic: bool = False
    """The broker's ``atomic:`` setting: each producer transaction commits several events."""
    units: int = 0
    """Transactions of several events committed (with ``atomic``)."""
    units_in_part: int = 0
    """Of those, the ones a consumer could see in part: some copy of a member stored without
    the rest of its transaction at contiguous sequences in one batch, which may hold other
    whole transactions (``units_in_part``)."""
    units_in_part_ids: list[str] = field(default_factory=list)
    wake_first: str = ""
    """The wake-up mechanism the router's log names first."""
    wake_cuts: int = 0
    """Times the run cut the relay's connections that follow the database's log."""
    wake_connections_cut: int = 0
    wake_cuts_recovered: int = 0
    """Of the cuts, those after which every cut connection logged its fallback at once and
    a log session started again (``cuts_recovered``)."""
    wake_log_starts: int = 0
    """``wakeup.active`` lines naming the log: each worker's start, each reconnect."""
    wake_fallbacks: int = 0
    producer_retries: int = 0
    workers_started: int = 0
    workers_ready: int = 0
    workers_never_ready: int = 0
    workers_never_ready_disrupted: int = 0
    """Of those never ready, the ones the run killed or stopped before they were."""
    ready_median_seconds: float = 0.0
    ready_max_seconds: float = 0.0
    ready_seconds: list[float] = field(default_factory=list)
    seconds: float = 0.0
    inbox: bool = False
    consumer_deliveries: int = 0
    duplicate_deliveries: int = 0
    effects: int = 0
    duplicate_effects: int = 0
    disruptions: list[tuple[float, str]] = field(default_factory=list)
    """(seconds since the producers started, what): every disruption, in order."""
    lost_ids: list[str] = field(default_factory=list)
    unexplained_duplicates: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """0 lost, 0 order violations, every duplicate explained by a disruption (a graceful
        stop explains none); with poison, every poisoned key seen stopped; with atomic, no
        transaction seen in part; with the inbox, one effect per committed event however often
        it was delivered."""
        relay = self.lost == 0 and self.order_violations == 0 and self.duplicates_not_in_flight == 0
        relay = relay and self.keys_stopped == self.poison and self.units_in_part == 0
        consumer = not self.inbox or (
            self.duplicate_effects == 0 and self.effects == self.committed
        )
        return relay and consumer

    @property
    def duplicates_per_kill(self) -> float:
        """Duplicated messages per worker SIGKILL (0.0 without kills)."""
        return self.duplicated / self.worker_kills if self.worker_kills else 0.0

    def set_delays(self, delays: Iterable[float]) -> None:
        """Fill the commit-to-publish figures from every first delivery's delay."""
        figures = delay_figures(delays)
        self.p50_delay_seconds, self.p99_delay_seconds = figures.p50, figures.p99
        self.max_delay_seconds = figures.max

    def set_worker_starts(self, starts: WorkerStarts, disrupted: set[int]) -> None:
        """Fill the start-to-ready figures; ``disrupted``: pids the run killed or stopped."""
        self.ready_seconds = sorted(starts.ready.values())
        self.workers_started, self.workers_ready = len(starts.started), len(starts.ready)
        self.workers_never_ready = len(starts.never_ready)
        self.workers_never_ready_disrupted = len(set(starts.never_ready) & disrupted)
        if self.ready_seconds:
            self.ready_median_seconds = statistics.median(self.ready_seconds)
            self.ready_max_seconds = self.ready_seconds[-1]

    def set_wakeups(
        self, changes: Sequence[WakeupChange], cuts: Iterable[tuple[float, int]]
    ) -> None:
        """Fill the wake-up figures from the router's log and the run's ``cuts`` of the log
        connections ((when, connections cut), the log's clock)."""
        self.wake_first = changes[0].mechanism if changes else ""
        self.wake_log_starts = sum(1 for c in changes if _follows_log(c))
        self.wake_fallbacks = sum(1 for c in changes if c.event == "wakeup.fallback")
        self.wake_cuts_recovered = cuts_recovered(cuts, changes)

    def to_json(self) -> dict[str, Any]:
        """Every field, the derived figures and the verdict."""
        return {
            **asdict(self),
            "duplicates_per_kill": round(self.duplicates_per_kill, 3),
            "passed": self.passed,
        }

    def table(self) -> str:
        """A readable summary."""
        rows = [
            ("events committed", self.committed),
            ("events delivered", self.delivered),
            ("lost", self.lost),
            ("duplicated (messages)", self.duplicated),
            ("  not in flight at a disruption", self.duplicates_not_in_flight),
            ("  per worker kill", f"{self.duplicates_per_kill:.2f}"),
            ("  after a graceful stop", self.duplicates_after_graceful_stop),
            ("per-stream order violations", self.order_violations),
            ("commit-to-publish delay p50 (s)", f"{self.p50_delay_seconds:.3f}"),
            ("commit-to-publish delay p99 (s)", f"{self.p99_delay_seconds:.3f}"),
            ("commit-to-publish delay max (s)", f"{self.max_delay_seconds:.3f}"),
            ("longest stall (s)", self._stall()),
            ("worker kills (SIGKILL)", self.worker_kills),
            ("graceful stops (SIGTERM)", self.graceful_stops),
            (f"broker restarts ({self.broker_stop})", self.broker_restarts),
            ("partitions (path to the broker silent)", self.partitions),
            ("database restarts", self.database_restarts),
            (f"wake-up (wakeup: {self.wakeup}), first used", self.wake_first or "-"),
            ("  log sessions started / fallbacks", self._wake_changes()),
            ("  log connections cut (recovered)", self._wake_cuts()),
            ("ordering", self.ordering),
            *self._poison_rows(),
            *self._unit_rows(),
            ("producer retries (unknown commit)", self.producer_retries),
            ("workers started / ready", f"{self.workers_started} / {self.workers_ready}"),
            ("  never ready (killed first)", self._never_ready()),
            ("  start-to-ready median (s)", f"{self.ready_median_seconds:.3f}"),
            ("  start-to-ready max (s)", f"{self.ready_max_seconds:.3f}"),
            ("run time (s)", f"{self.seconds:.1f}"),
        ]
        if self.inbox:
            rows += [
                ("inbox consumer: deliveries", self.consumer_deliveries),
                ("  duplicate deliveries", self.duplicate_deliveries),
                ("  events with an effect", self.effects),
                ("  duplicate effects", self.duplicate_effects),
            ]
        width = max(len(name) for name, _ in rows)
        lines = [f"chaos ({self.size}, {self.streams} streams, {self.database}, seed {self.seed})"]
        lines += [f"  {name:<{width}}  {value}" for name, value in rows]
        lines.append("  PASSED" if self.passed else "  FAILED")
        return "\n".join(lines)

    def _stall(self) -> str:
        start, seconds = self.longest_stall_from_seconds, self.longest_stall_seconds
        text = f"{seconds:.3f} from {start:.1f} s"
        near = disruptions_near(self.disruptions, start, start + seconds)
        if near:
            text += ": " + ", ".join(f"{what} at {at:.1f}" for at, what in near)
        return text

    def _unit_rows(self) -> list[tuple[str, object]]:
        if not self.atomic:
            return []
        return [
            ("atomic: transactions of several events", self.units),
            ("  of them seen in part by a consumer", self.units_in_part),
        ]

    def _poison_rows(self) -> list[tuple[str, object]]:
        if not self.poison:
            return []
        return [
            ("  poison events (past max_msg_size)", self.poison),
            ("  keys stopped at once (as)", f"{self.keys_stopped} ({', '.join(self.stopped_as)})"),
            ("  rows waiting behind them", self.rows_behind),
            ("  released (router release)", self.releases),
            ("  first hold to last release (s)", f"{self.hold_to_release_seconds:.3f}"),
            ("  their streams' events (max delay)", self._stopped_events()),
        ]

    def _stopped_events(self) -> str:
        left_out = "left out of the delays and stall above"
        return f"{self.stopped_events} ({self.stopped_max_delay_seconds:.3f} s), {left_out}"

    def _wake_changes(self) -> str:
        return f"{self.wake_log_starts} / {self.wake_fallbacks}"

    def _wake_cuts(self) -> str:
        connections = f"{self.wake_connections_cut} connections"
        return f"{self.wake_cuts} times, {connections} ({self.wake_cuts_recovered})"

    def _never_ready(self) -> str:
        return f"{self.workers_never_ready} ({self.workers_never_ready_disrupted})"
