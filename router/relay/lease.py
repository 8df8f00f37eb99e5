"""A claim's lease as its processor keeps it: when it ends, and its heartbeat.

The database ends a lease at ``locked_until``. The processor counts the end on the event
loop's clock from the moment before it sent the claim, so its count never ends later than the
database's. Before each wave of a batch, ``Delivery`` asks for time enough to publish it; when
less is left, one UPDATE fenced by the claim's token (``OutboxStore.extend``) moves the end on.
So a batch split into many waves may outlive ``outbox.lease_seconds`` without another worker
claiming its rows and publishing them a second time.
"""

from __future__ import annotations

import asyncio
import logging

from envelopes import DatabaseError
from router.relay.store import Claim, OutboxStore

__all__ = ["Lease"]

log = logging.getLogger(__name__)


class Lease:
    """One claim's lease: ``end`` on the event loop's clock, and ``keep`` to extend it."""

    def __init__(
        self,
        store: OutboxStore,
        target: str,
        claim: Claim,
        *,
        seconds: float,
        end: float,
        labels: dict[str, str],
    ) -> None:
        """``seconds`` is ``outbox.lease_seconds``; ``end`` when the claim's lease ends."""
        self.end = end
        self._store = store
        self._target = target
        self._token = claim.token
        self._rows = len(claim)  # none is marked before the batch's end, so all are held
        self._seconds = seconds
        self._log = labels

    async def keep(self, seconds: float) -> bool:
        """Make sure at least ``seconds`` of the lease are left, extending it when fewer are;
        False when the claim no longer holds all its rows (others took some over, or the
        database could not say)."""
        now = asyncio.get_running_loop().time()
        if self.end - now >= seconds:
            return True
        # A second more than asked for, so the next wave does not have to extend it again at
        # once; never less than a claim's own lease.
        length = max(self._seconds, seconds + 1)
        try:
            held = await self._store.extend(self._target, self._token, length)
        except DatabaseError as exc:
            # Whether it was extended is unknown: the rows may be claimable before the next
            # wave is acknowledged.
            return self._lost(None, str(exc))
        if held < self._rows:
            # The lease ran out (the loop stalled, the database was slow, or the worker was
            # taken for dead) and another claim took rows over: that claim publishes them.
            return self._lost(held, None)
        self.end = now + length
        return True

    def _lost(self, held: int | None, error: str | None) -> bool:
        log.warning(
            "batch.lease_lost",
            extra={**self._log, "rows": self._rows, "held": held, "error": error},
        )
        return False
