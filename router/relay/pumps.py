"""How a processor drains what is due: the delivery loop a store's claims need.

A store names its loop (``OutboxStore.pump``), since what differs is how its claims hold rows:

- ``Overlapping`` (SQLite, MariaDB/MySQL): a claim leases its rows and commits at once. While
  a full batch is being published the next is already claimed beside it: at most two batches
  are in flight, so claiming and marking overlap publishing and memory stays bounded however
  long the backlog. Rows of one stream are never in two batches at once (a claim skips rows
  whose predecessor is in flight), so the overlap keeps every stream in order.
- ``TransactionRuns`` (PostgreSQL): a batch holds its target until its transaction commits,
  so batches go in runs of one transaction, each claimed in the transaction of the one before.

Both are driven through the processor's batch operations (``Cycle``); the processor schedules
(wake-ups, idle waits, probes, shutdown), the loops only claim, deliver and mark.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sized
from typing import Any, Generic, Protocol, TypeVar

from router.relay.streams import RunStreams

__all__ = ["Batch", "Cycle", "Overlapping", "Pump", "TransactionRuns"]

# A run of PostgreSQL batches (one transaction) claims no further batch after this long
# (seconds): its outcomes become visible when it commits, and the transaction holds back the
# database's vacuum horizon while it lasts.
_RUN_SECONDS = 0.5


class Batch(Protocol):
    """A claim as a loop sees it (``router.relay.store.Claim``; this module imports no store,
    which imports it)."""

    @property
    def token(self) -> int:
        """The claim's fencing token."""

    @property
    def rows(self) -> Sized:
        """The rows it leased (none: nothing was due)."""

    @property
    def busy(self) -> bool:
        """Nothing claimed: another batch of the target is in flight."""

    def __len__(self) -> int: ...


Claim = TypeVar("Claim", bound=Batch)
Marks = TypeVar("Marks")


class Cycle(Protocol[Claim, Marks]):
    """The processor's batch operations, as a loop drives them."""

    @property
    def halted(self) -> bool:
        """Stopping, or cut off from the broker: claim nothing more."""

    def claim_limit(self) -> int:
        """Rows the next claim may take (0: the rate limit has too few tokens yet)."""

    def token_wait(self) -> float:
        """Seconds until the rate limit allows the next claim."""

    def busy(self) -> float:
        """How long to wait before asking again for a target another batch holds."""

    def not_busy(self) -> None:
        """A claim got through: the next busy wait starts short again."""

    async def claim(self, limit: int, after: Claim | None = None) -> tuple[Claim, float]:
        """A claim and its lease's end on the loop's clock."""

    async def deliver_and_mark(self, claim: Claim, end: float) -> None:
        """Publish a batch and write its outcomes."""

    async def deliver(
        self, claim: Claim, end: float, streams: RunStreams
    ) -> tuple[Marks | None, float]:
        """Publish a batch: its outcomes (None: a stop cancelled its connect) and the end of
        its lease. ``streams``: what the run's earlier batches left of their streams."""

    async def finish(
        self, claim: Claim, marks: Marks, deadline: float, before: asyncio.Task[None] | None
    ) -> None:
        """Write a batch's outcomes, after ``before`` (the mark of the batch before it)."""

    def hold(self, claim: Claim) -> None:
        """Count a batch as in flight until it is marked or given back."""

    async def give_back(self, claims: list[Claim]) -> None:
        """Release claimed batches that will not be published, untried."""

    async def idle_timeout(self, handled: int, limit: int) -> float | None:
        """None to go on at once; otherwise how long to wait for a wake-up."""


class Pump(Protocol):
    """One target's delivery loop, made by the store's ``pump`` over a processor's ``Cycle``."""

    async def __call__(self) -> float | None:
        """Deliver while there is work; then say how long to wait (None: go on at once)."""


class Overlapping(Generic[Claim, Marks]):
    """Claims beside publishing, for stores whose claims commit at once."""

    def __init__(self, cycle: Cycle[Claim, Marks]) -> None:
        self.cycle = cycle

    async def __call__(self) -> float | None:
        """Deliver batches while they come back full, claiming the next during the publish
        of the current; then say how long to wait (None: go on at once)."""
        cycle = self.cycle
        previous: asyncio.Task[None] | None = None
        current: asyncio.Task[None] | None = None
        claimed, limit = 0, 0
        try:
            while True:
                limit = cycle.claim_limit()
                if limit == 0:  # the rate limit holds the pace: wait for its tokens
                    break
                claim, end = await cycle.claim(limit)
                claimed = len(claim)
                current = (
                    asyncio.create_task(cycle.deliver_and_mark(claim, end)) if claim.rows else None
                )
                # A claim made while a batch was in flight skips the rows queued behind that
                # batch in their streams: short, it says nothing about what is left.
                overlapped = previous is not None
                if previous is not None:
                    await previous
                previous, current = current, None
                if cycle.halted:
                    break
                if claimed < limit and not overlapped:
                    break
            if previous is not None:
                await previous
                previous = None
        finally:
            await settle(previous, current)
        if limit == 0:
            return cycle.token_wait()
        return await cycle.idle_timeout(claimed, limit)


class TransactionRuns(Generic[Claim, Marks]):
    """Runs of batches, each run one transaction that holds the target until it commits
    (PostgreSQL: a claim may come back ``busy`` while another worker's run holds it).

    While a batch is published the next one is claimed in the same transaction (the rows
    after it), and while that one is published the first is marked: claims and marks overlap
    publishing. The next batch is published only once the current one is done, never beside
    it, since its rows may follow the current one's in their streams; a row whose stream
    failed earlier in the run is held back (untried), and one whose stream had a row abandoned
    earlier in the run names it (``RunStreams``). The run claims no further batch once one
    comes back short, after ``_RUN_SECONDS``, at a stop, with the circuit open or the rate
    limit reached; it commits with the mark of its last batch.
    """

    def __init__(self, cycle: Cycle[Claim, Marks]) -> None:
        self.cycle = cycle

    async def __call__(self) -> float | None:
        """One run; then how long to wait (None: go on at once)."""
        cycle = self.cycle
        limit = cycle.claim_limit()
        if limit == 0:
            return cycle.token_wait()
        claim, end = await cycle.claim(limit)
        if claim.busy:
            return cycle.busy()
        cycle.not_busy()
        closes = asyncio.get_running_loop().time() + _RUN_SECONDS
        streams = RunStreams()  # failures and gaps earlier in the run, unmarked yet
        unmarked: dict[int, Claim] = {}  # claimed, and neither being marked nor left to stop
        marking: asyncio.Task[None] | None = None
        following: asyncio.Task[tuple[Claim, float]] | None = None
        # At least the limit: an atomic target's claim takes the rest of a transaction it
        # cut, so a full claim can hold more rows than asked for (``_full``).
        full = _full(claim, limit)
        try:
            while claim.rows:
                unmarked[claim.token] = claim
                cycle.hold(claim)
                more = self._goes_on(full, closes)
                if more:
                    following = asyncio.create_task(self._claim_after(claim, more, marking))
                marks, deadline = await cycle.deliver(claim, end, streams)
                del unmarked[claim.token]
                if marks is None:  # a connect cancelled by stop(): the processor gives it back
                    break
                marking = asyncio.create_task(cycle.finish(claim, marks, deadline, marking))
                if following is None or cycle.halted:  # cut off: give the next back
                    break
                claim, end = await following
                following = None
                full = _full(claim, more)
        finally:
            await settle(following, marking)
            if following is not None and not following.cancelled() and not following.exception():
                extra, _ = following.result()  # claimed, and the run ended before its turn
                unmarked[extra.token] = extra
            await cycle.give_back(list(unmarked.values()))
        if marking is not None:
            await marking  # its error, if the last mark failed
        if claim.busy:  # the run's next claim met the ring's gate (PostgreSQL)
            return cycle.busy()
        if full and claim.rows:
            return None  # more may be waiting: go on at once
        return await cycle.idle_timeout(len(claim), limit)

    def _goes_on(self, full: bool, closes: float) -> int:
        """How many rows the run's next batch may take (0: the run ends with this batch)."""
        if not full or self.cycle.halted:
            return 0
        if asyncio.get_running_loop().time() >= closes:
            return 0
        return self.cycle.claim_limit()

    async def _claim_after(
        self, claim: Claim, limit: int, marking: asyncio.Task[None] | None
    ) -> tuple[Claim, float]:
        """The batch after ``claim``, in its transaction, claimed once ``marking`` (the mark of
        the batch before ``claim``) is written, so the claim sees that batch's failures;
        ``claim``'s own failures are not known yet, and the run holds their streams back."""
        if marking is not None:
            await asyncio.wait({marking})
        return await self.cycle.claim(limit, after=claim)


def _full(claim: Sized, limit: int) -> bool:
    """Whether a claim took all it was allowed, so more rows may be waiting."""
    return len(claim) >= limit


async def settle(*tasks: asyncio.Task[Any] | None) -> None:
    """Leave no batch task behind: when we are being cancelled, cancel them too; otherwise
    (another batch failed) let them finish, so their outcomes are written.

    Every task's failure is read here, finished ones' too: when the run fails on something
    else, nothing else reads them, and asyncio would report them as never retrieved.
    """
    running = []
    for t in tasks:
        if t is None:
            continue
        if not t.done():
            running.append(t)
        elif not t.cancelled():
            t.exception()  # read: its failure is no longer reported at collection
    if not running:
        return
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        for t in running:
            t.cancel()
    await asyncio.gather(*running, return_exceptions=True)
