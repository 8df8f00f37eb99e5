"""An atomic target's claim made whole, the same way on every database
(``OutboxStore.claim(..., units=True)``).

Each claimed row gets its unit (the application transaction that staged it: PostgreSQL's
``xid``, the client's token on MySQL/MariaDB and SQLite), and while the claim holds only part
of a unit, it claims on past its last row, as a claim of its run would (streams in order, held
and parked rows never taken), a few times at most. A unit still partly claimed then (a member
waits behind its stream, is held or parked, or is in flight under another claim) has its rows
``whole=False``: delivery sends none of them, and they are claimed again once the member can
go. A row without a unit (staged before its target had ``atomic``, on a database that did not
record transactions then) is a unit of its own.

Each store gives the loop its two statements, in the claim's transaction: ``count`` (each
new row's unit, and how many rows of the unit the target has open or set aside) and
``claim_on`` (up to so many more rows after a seq).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence

from router.relay.store.base import ClaimedRow

__all__ = ["EXTENSIONS", "EXTENSION_ROWS", "ClaimOn", "CountUnits", "complete_units"]

EXTENSIONS = 4
"""How often a claim claims on to complete the units it cut, at most."""
EXTENSION_ROWS = 16
"""The fewest rows it claims on by each time."""

CountUnits = Callable[[Sequence[int]], Awaitable[Iterable[tuple[int, int | None, int]]]]
"""``(seq, unit, open rows of the unit)`` for each of the given seqs still queued."""
ClaimOn = Callable[[int, int], Awaitable[list[ClaimedRow]]]
"""Claim up to ``limit`` more rows after ``seq`` (``(seq, limit)``), in outbox order."""


async def complete_units(rows: list[ClaimedRow], count: CountUnits, claim_on: ClaimOn) -> None:
    """Set each row's ``unit`` and ``whole``, claiming on past the last row (``rows`` in
    outbox order, extended in place) while the claim holds part of a unit."""
    unit_of: dict[int, int | None] = {}
    open_rows: dict[int, int] = {}
    new: Sequence[ClaimedRow] = rows[:]
    claimed: Counter[int | None] = Counter()
    for extension in range(EXTENSIONS + 1):
        for seq, unit, total in await count([r.seq for r in new]):
            unit_of[seq] = unit
            if unit is not None:
                open_rows[unit] = total
        claimed = Counter(unit_of.get(r.seq) for r in rows)
        missing = sum(max(0, n - claimed[unit]) for unit, n in open_rows.items())
        if not missing or extension == EXTENSIONS:
            break
        # Past the claim's last row: the missing rows, and room for the rows of other
        # transactions staged among them.
        new = await claim_on(rows[-1].seq, max(2 * missing, EXTENSION_ROWS))
        if not new:
            break
        rows.extend(new)
    for row in rows:
        row.unit = unit_of.get(row.seq)
        row.whole = row.seq in unit_of and (
            row.unit is None or open_rows[row.unit] == claimed[row.unit]
        )
