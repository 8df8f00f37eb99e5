"""What the processor needs from a database: claim, mark, release, and when to look again;
and what a worker pool needs: the leases of a worker that died, given back at once."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from envelopes import DatabaseError, SchemaError
from router._schema import VERSION_TABLE
from router.relay.pumps import Cycle, Pump
from router.relay.store.outage import Outage

__all__ = [
    "ECHO_AFTER",
    "OPEN_STATUSES",
    "OPEN_STATUSES_SQL",
    "SCHEMA_REVISION",
    "SET_ASIDE_STATUSES",
    "VERSION_TABLE",
    "BatchLost",
    "Claim",
    "ClaimedRow",
    "Echo",
    "Marks",
    "OutboxStore",
    "Wake",
    "Wakeup",
    "describe_error",
    "name_gaps",
    "new_token",
    "schema_problem",
]

OPEN_STATUSES = ("pending", "processing", "failed")
OPEN_STATUSES_SQL = ", ".join(f"'{status}'" for status in OPEN_STATUSES)
"""The open states as an SQL list, for ``status IN (...)``."""

SET_ASIDE_STATUSES = ("held", "parked")
"""A stream's head that its target's ``ordering`` keeps instead of abandoning it (``hold``,
``park``; docs/guarantees.md): never claimed, and holding back the later rows of its stream
on its target until an operator releases it (``router release``). Not open: no claim takes
them, whatever their due time."""

# The migration this code's SQL needs. Read from the version table at start instead of asking
# alembic, which would cost a fifth of a second of imports before the first claim;
# tests/e2e/test_serve_schema.py keeps it equal to the newest shipped migration.
SCHEMA_REVISION = "0022"


def schema_problem(database: str, revision: str | None) -> SchemaError | None:
    """The error for a database at ``revision`` (None: never migrated), or None when current."""
    if revision == SCHEMA_REVISION:
        return None
    if revision is None:
        return SchemaError(
            f"database {database!r} has no router tables; run `router init-db` first"
        )
    return SchemaError(
        f"database {database!r} is at schema {revision}, this router needs "
        f"{SCHEMA_REVISION}; run `router init-db` to upgrade it"
    )


def describe_error(exc: BaseException) -> str:
    """A driver error as ``Type: message``, for logs and ``DatabaseError``: nothing of the
    URL, since asyncpg, asyncmy and sqlite3 never put the password in their messages."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class BatchLost(DatabaseError):
    """A batch's outcomes cannot be written any more: the transaction that held its rows
    ended (PostgreSQL: the session was closed, or timed out idle). Its rows are queued as they
    were and will be delivered again; trying the mark again cannot help."""


Wake = Callable[[set[str] | None], None]
"""Called with the targets that have new rows (``None``: every target)."""

ECHO_AFTER = 0.02
"""Seconds after the last wake-up from a database's log that ``Echo`` wakes once more."""


class Echo:
    """A wake-up from a database's log, and its echo.

    A log (PostgreSQL's WAL, the MySQL binlog) may carry a commit a moment before its rows are
    visible to other sessions, so a claim woken at once can miss them and nothing would wake
    it again. ``Echo`` calls ``wake`` at once and once more ``after`` seconds after the last
    call, for the targets of every call since the last echo (None, every target, absorbs
    any set): each commit gets its echo at least ``after`` seconds after its own wake-up, and
    a steady stream of commits one timer, not one each."""

    def __init__(self, wake: Wake, after: float = ECHO_AFTER) -> None:
        self._wake = wake
        self._after = after
        self._pending: set[str] | None = set()
        self._timer: asyncio.TimerHandle | None = None
        self._last = 0.0  # the event loop's time of the last call

    def __call__(self, targets: set[str] | None) -> None:
        """Wake ``targets`` now, and again with the echo (on the event loop's thread)."""
        self._wake(targets)
        if targets is None or self._pending is None:
            self._pending = None
        else:
            self._pending |= targets
        loop = asyncio.get_running_loop()
        self._last = loop.time()
        # One timer for a stream of calls, moved on when it fires early: a timer cancelled
        # and made again per call cost the log follower about 4 of its 40 us a commit.
        if self._timer is None:
            self._timer = loop.call_later(self._after, self._echo)

    def _echo(self) -> None:
        loop = asyncio.get_running_loop()
        if (left := self._last + self._after - loop.time()) > 0:  # called again since
            self._timer = loop.call_later(left, self._echo)
            return
        targets, self._pending, self._timer = self._pending, set(), None
        self._wake(targets)

    def cancel(self) -> None:
        """Drop a pending echo (the follower stops)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class Wakeup(NamedTuple):
    """How a store's watcher learns of rows other processes commit, for ``router check`` and
    ``router status``: ``mechanism`` is 'log' (the database's own log), 'notify' or 'poll';
    ``reason`` says why this one (the setting, or what keeps a better one off)."""

    mechanism: str
    reason: str


@dataclass(slots=True)  # not frozen, like WireMessage: one is made per claimed row
class ClaimedRow:
    """One row a processor holds under lease; ``attempts`` counts this attempt."""

    seq: int
    message_id: str
    destination: str
    envelope: str
    attempts: int
    stream_key: str | None = None
    created_at: float | None = None  # epoch seconds, for commit-to-ack latency
    skipped: tuple[str, ...] = ()
    """The gap before this row in its stream on its target: the message ids of the rows of
    the stream abandoned there and not yet named by a published row, oldest first (the
    claim reads them from ``router_gaps``; delivery adds those its run opened since)."""
    unit: int | None = None
    """On a target with ``atomic``: the application transaction that staged the row (its
    unit: the rows of one transaction for one target, published as one atomic write)."""
    whole: bool = True
    """On a target with ``atomic``: False when the claim could not take every open row of
    the row's unit (one waits behind its stream, or is held or parked): the unit stays."""


def name_gaps(rows: Sequence[ClaimedRow], gaps: Iterable[tuple[str, int, str]]) -> None:
    """Give each claimed row with a stream key its ``skipped``: of ``gaps``, the target's
    ``(stream key, seq, message id)`` in seq order, those of its stream before it."""
    by_key: dict[str, list[tuple[int, str]]] = {}
    for key, seq, message_id in gaps:
        by_key.setdefault(key, []).append((seq, message_id))
    for row in rows:
        found = by_key.get(row.stream_key) if row.stream_key is not None else None
        if found:
            row.skipped = tuple(message_id for seq, message_id in found if seq < row.seq)


@dataclass(frozen=True, slots=True)
class Claim:
    """The rows one claim leased, in outbox order, and the claim's fencing token. ``busy``:
    nothing was claimed because another batch of the target is in flight (a store whose
    ``pump`` is ``TransactionRuns``); ask again later."""

    token: int
    rows: list[ClaimedRow]
    busy: bool = False

    def __len__(self) -> int:
        return len(self.rows)


def new_token() -> int:
    """A fencing token: random, so every claim's is distinct (no counter to share)."""
    return secrets.randbits(63)


@dataclass(slots=True)
class Marks:
    """Outcomes of one batch, written back with one statement per kind."""

    published: list[int] = field(default_factory=list)
    receipts: dict[int, str] = field(default_factory=dict)
    """seq -> the broker's receipt (JSON object text), for published rows that have one"""
    failed: list[tuple[int, float, str]] = field(default_factory=list)
    """(seq, seconds until the next attempt, error)"""
    abandoned: list[tuple[int, str]] = field(default_factory=list)
    """(seq, error)"""
    held: list[tuple[int, str]] = field(default_factory=list)
    """(seq, error): stream heads given up on, on a target whose ``ordering`` is ``hold``:
    kept with their error, holding back their streams, and no gap recorded."""
    parked: list[tuple[int, str, str]] = field(default_factory=list)
    """(seq, stream key, error): stream heads given up on, on a target whose ``ordering`` is
    ``park``: parked, with every later open row of their stream on the target."""
    untried: list[int] = field(default_factory=list)
    """Claimed but not sent (held back behind a failed row of their stream): released."""
    reported: list[tuple[str, str]] = field(default_factory=list)
    """(stream key, message id) of each gap a published row named (its ``skipped``): its
    consumer knows of it now, so it is deleted with the marks. Not a row's outcome."""

    def __len__(self) -> int:
        given_up = len(self.abandoned) + len(self.held) + len(self.parked)
        return len(self.published) + len(self.failed) + given_up + len(self.untried)


class OutboxStore(Protocol):
    """One database's outbox, as the processors of its targets use it."""

    kind: str
    outage: Outage
    """Whether the database is down, shared by its processors and its watcher, which log
    only when that changes."""

    @property
    def pump(self) -> Callable[[Cycle[Claim, Marks]], Pump]:
        """The delivery loop its claims need (``router.relay.pumps``): ``TransactionRuns``
        where a claim holds its rows in a transaction until its batch is marked, one
        transaction of a target at a time (PostgreSQL: the next batch is claimed in the
        current one's transaction, ``after``, and a claim may come back ``busy``);
        ``Overlapping`` where a claim commits at once."""

    @property
    def wakeup(self) -> Wakeup:
        """How the store's watcher learns of new rows now, and why that one."""

    async def probe_wakeup(self) -> Wakeup:
        """The wake-up ``watch`` would pick if it started now, and why, found by read-only
        queries without starting a follower (``router check``, ``router status``)."""

    async def claim(
        self,
        target: str,
        limit: int,
        worker: str,
        lease_seconds: float,
        after: Claim | None = None,
        *,
        units: bool = False,
    ) -> Claim:
        """Lease up to ``limit`` due rows of ``target`` in outbox order.

        A row whose stream has an earlier open row that is not claimable now (waiting to
        retry, or in flight under another lease), or an earlier held or parked row, is not
        claimed: streams stay in order; a held or parked row is never claimed. Where the
        target has a parked stream, the claim parks the rows it finds behind it (staged since
        it was parked). A
        row with a stream key comes with the gaps before it (``ClaimedRow.skipped``), found
        in the claim's own statements: a target without gaps pays no statement more.
        ``after`` (only where ``pump`` is ``TransactionRuns``): a batch still held, whose
        transaction the claim joins, taking the rows after it.

        ``units`` (a target with ``atomic``): each row comes with its unit, and the claim
        takes more rows past ``limit`` to complete the units it cut; a unit it still could
        not complete has its rows ``whole=False`` (``router.relay.store.units``, one loop
        for every store).
        """

    async def mark(self, target: str, token: int, marks: Marks) -> None:
        """Write back a batch's outcomes for rows still held under ``token``: with each
        abandoned row that has a stream key, its gap (in ``router_gaps``); and delete the
        gaps the published rows named (``Marks.reported``). A parked head parks, in the same
        mark, every later open row of its stream on the target."""

    async def release(self, target: str, token: int, seqs: Sequence[int]) -> None:
        """Give back rows that were claimed but not tried; their attempt does not count."""

    async def extend(self, target: str, token: int, lease_seconds: float) -> int:
        """Hold the rows still under ``token`` until ``lease_seconds`` from now, in one
        statement; returns how many that is (fewer than claimed: others took some over)."""

    async def release_worker(self, worker: str) -> int:
        """Give back every row ``worker`` holds, in one statement (its process is gone, so
        its batches will never be marked); returns how many. Attempts do not count, as for
        ``release``, and the other processors of the rows' targets are woken."""

    async def next_due(self, target: str) -> float | None:
        """Seconds until the earliest open row of ``target`` is due (``None``: no open rows)."""

    async def paused(self, target: str) -> bool:
        """Whether ``target`` is paused (``router pause``): no worker claims its rows."""

    async def record_circuit(self, target: str, state: str, worker: str, error: str | None) -> None:
        """Note a target's circuit state where ``router status`` can see it."""

    async def watch(self, wake: Wake) -> None:
        """Call ``wake`` whenever rows may have been added; runs until cancelled."""

    async def idle(self, target: str) -> float | None:
        """``target``'s processor found nothing to claim and is about to wait: seconds
        within which it must look again (0: at once), or None to wait for a wake-up alone.
        Where writers wake the relay only while it shows it is idle (PostgreSQL), this is
        where it shows it."""

    def busy(self, target: str) -> None:
        """``target``'s processor was woken (or its wait timed out): it is no longer idle."""

    async def check_schema(self) -> None:
        """Raise ``SchemaError`` unless the router's tables are at ``SCHEMA_REVISION``
        (``DatabaseError`` when the database cannot be reached)."""

    async def close(self) -> None:
        """Close connections."""
