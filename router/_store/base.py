"""What the processor needs from a database: claim, mark, release, and when to look again."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["OPEN_STATUSES", "ClaimedRow", "Marks", "OutboxStore", "Wake"]

OPEN_STATUSES = ("pending", "processing", "failed")

Wake = Callable[[set[str] | None], None]
"""Called with the targets that have new rows (``None``: every target)."""


@dataclass(frozen=True, slots=True)
class ClaimedRow:
    """One row a processor holds under lease; ``attempts`` counts this attempt."""

    seq: int
    message_id: str
    destination: str
    envelope: str
    attempts: int


@dataclass(slots=True)
class Marks:
    """Outcomes of one batch, written back with one statement per kind."""

    published: list[int] = field(default_factory=list)
    failed: list[tuple[int, float, str]] = field(default_factory=list)
    """(seq, seconds until the next attempt, error)"""
    abandoned: list[tuple[int, str]] = field(default_factory=list)
    """(seq, error)"""

    def __len__(self) -> int:
        return len(self.published) + len(self.failed) + len(self.abandoned)


class OutboxStore(Protocol):
    """One database's outbox, as the processors of its targets use it."""

    kind: str

    async def claim(
        self, target: str, limit: int, worker: str, lease_seconds: float
    ) -> list[ClaimedRow]:
        """Lease up to ``limit`` due rows of ``target`` in outbox order."""

    async def mark(self, target: str, worker: str, marks: Marks) -> None:
        """Write back a batch's outcomes for rows this worker still holds."""

    async def release(self, target: str, worker: str, seqs: Sequence[int]) -> None:
        """Give back rows that were claimed but not tried; their attempt does not count."""

    async def next_due(self, target: str) -> float | None:
        """Seconds until the earliest open row of ``target`` is due (``None``: no open rows)."""

    async def watch(self, wake: Wake) -> None:
        """Call ``wake`` whenever rows may have been added; runs until cancelled."""

    async def ping(self) -> None:
        """Raise ``DatabaseError`` unless the database answers and has the outbox table."""

    async def close(self) -> None:
        """Close connections."""
