"""A run of batches in one transaction (``router.relay.pumps.TransactionRuns``), driven over a
scripted cycle: which claims the run makes and when it ends."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from router.relay.pumps import TransactionRuns
from router.relay.streams import RunStreams


@dataclass
class Batch:
    token: int
    rows: list[int]
    busy: bool = False

    def __len__(self) -> int:
        return len(self.rows)


@dataclass
class Cycle:
    """Claims come back with the sizes given, in order (then empty); every batch is
    delivered and marked at once."""

    sizes: list[int]
    limit: int
    claims: list[tuple[int, int | None]] = field(default_factory=list)  # (limit, after token)
    marked: list[int] = field(default_factory=list)
    given_back: list[int] = field(default_factory=list)

    @property
    def halted(self) -> bool:
        return False

    def claim_limit(self) -> int:
        return self.limit

    def token_wait(self) -> float:
        return 0.0

    def busy(self) -> float:
        return 0.0

    def not_busy(self) -> None:
        pass

    async def claim(self, limit: int, after: Batch | None = None) -> tuple[Batch, float]:
        token = len(self.claims) + 1
        self.claims.append((limit, None if after is None else after.token))
        size = self.sizes[token - 1] if token <= len(self.sizes) else 0
        return Batch(token, list(range(size))), 30.0

    async def deliver_and_mark(self, claim: Batch, end: float) -> None:
        raise AssertionError("a run delivers with deliver() and finish()")

    async def deliver(self, claim: Batch, end: float, streams: RunStreams) -> tuple[str, float]:
        await asyncio.sleep(0)
        return "marks", end

    async def finish(
        self, claim: Batch, marks: str, deadline: float, before: asyncio.Task[None] | None
    ) -> None:
        if before is not None:
            await before
        self.marked.append(claim.token)

    def hold(self, claim: Batch) -> None:
        pass

    async def give_back(self, claims: list[Batch]) -> None:
        self.given_back.extend(c.token for c in claims)

    async def idle_timeout(self, handled: int, limit: int) -> float | None:
        return 1.0


async def test_a_full_claim_is_followed_in_its_run_by_the_next() -> None:
    cycle = Cycle(sizes=[4, 4, 1], limit=4)

    assert await TransactionRuns(cycle)() == 1.0  # the last claim was short: idle

    assert cycle.claims == [(4, None), (4, 1), (4, 2)]
    assert cycle.marked == [1, 2, 3]
    assert cycle.given_back == []


async def test_a_claim_that_took_more_than_its_limit_is_full() -> None:
    # An atomic target's claim takes the rest of a transaction it cut: 6 rows for a limit of
    # 4 is a full claim, and the run claims on in its transaction rather than ending.
    cycle = Cycle(sizes=[6, 5, 2], limit=4)

    assert await TransactionRuns(cycle)() == 1.0

    assert cycle.claims == [(4, None), (4, 1), (4, 2)]
    assert cycle.marked == [1, 2, 3]


async def test_a_run_ends_when_the_claim_after_a_full_one_finds_nothing() -> None:
    cycle = Cycle(sizes=[6], limit=4)

    assert await TransactionRuns(cycle)() == 1.0
    assert cycle.claims == [(4, None), (4, 1)]
    assert cycle.marked == [1]
