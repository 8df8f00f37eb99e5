"""What the processor needs from a database: claim, mark, release, and when to look again."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["OPEN_STATUSES", "Claim", "ClaimedRow", "Marks", "OutboxStore", "Wake", "new_token"]

OPEN_STATUSES = ("pending", "processing", "failed")

Wake = Callable[[set[str] | None], None]
"""Called with the targets that have new rows (``None``: every target)."""


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


@dataclass(frozen=True, slots=True)
class Claim:
    """The rows one claim leased, in outbox order, and the claim's fencing token."""

    token: int
    rows: list[ClaimedRow]

    def __len__(self) -> int:
        return len(self.rows)


def new_token() -> int:
    """A fencing token: random, so every claim's is distinct (no counter to share)."""
    return secrets.randbits(63)


@dataclass(slots=True)
class Marks:
    """Outcomes of one batch, written back with one statement per kind."""

    published: list[int] = field(default_factory=list)
    failed: list[tuple[int, float, str]] = field(default_factory=list)
    """(seq, seconds until the next attempt, error)"""
    abandoned: list[tuple[int, str]] = field(default_factory=list)
    """(seq, error)"""
    untried: list[int] = field(default_factory=list)
    """Claimed but not sent (held back behind a failed row of their stream): released."""

    def __len__(self) -> int:
        return len(self.published) + len(self.failed) + len(self.abandoned) + len(self.untried)


class OutboxStore(Protocol):
    """One database's outbox, as the processors of its targets use it."""

    kind: str

    async def claim(self, target: str, limit: int, worker: str, lease_seconds: float) -> Claim:
        """Lease up to ``limit`` due rows of ``target`` in outbox order.

        A row whose stream has an earlier open row that is not claimable now (waiting to
        retry, or in flight under another lease) is not claimed: streams stay in order.
        """

    async def mark(self, target: str, token: int, marks: Marks) -> None:
        """Write back a batch's outcomes for rows still held under ``token``."""

    async def release(self, target: str, token: int, seqs: Sequence[int]) -> None:
        """Give back rows that were claimed but not tried; their attempt does not count."""

    async def next_due(self, target: str) -> float | None:
        """Seconds until the earliest open row of ``target`` is due (``None``: no open rows)."""

    async def record_circuit(self, target: str, state: str, worker: str, error: str | None) -> None:
        """Note a target's circuit state where ``router status`` can see it."""

    async def watch(self, wake: Wake) -> None:
        """Call ``wake`` whenever rows may have been added; runs until cancelled."""

    async def ping(self) -> None:
        """Raise ``DatabaseError`` unless the database answers and has the outbox table."""

    async def close(self) -> None:
        """Close connections."""
