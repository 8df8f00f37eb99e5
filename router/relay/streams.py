"""What a run of batches learned about its streams that the run's own claims cannot see yet.

A claim reads each row's stream as the marks written so far left it: which streams wait
behind a failed row, which gaps lie before a row (``ClaimedRow.skipped``). Two things
come after that reading and before the row is sent. Within a batch the n-th row of a stream
goes in the n-th wave (``router.relay.delivery``), after the rows before it had their answer;
and on PostgreSQL the next batch of a run is claimed while the current one is published,
before its outcomes are marked (``router.relay.pumps.TransactionRuns``). ``RunStreams`` is
what those answers said, kept for the rest of the run (one batch where claims commit at once):

- ``held``: streams with a row that failed and will be retried, or that the target's
  ordering kept (held or parked): their later rows stay untried, and wait for it;
- gaps opened (a row of the stream abandoned) and closed (named by a row that was then
  published): a later row names the first and not the second, whatever its claim read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RunStreams"]


@dataclass(slots=True)
class RunStreams:
    """The streams of one run, as its deliveries left them."""

    held: set[str] = field(default_factory=set)
    """Streams with a row that failed earlier in the run, or was held or parked: their later
    rows stay untried."""
    _opened: dict[str, dict[int, str]] = field(default_factory=dict)  # key -> seq -> id
    _closed: dict[str, set[str]] = field(default_factory=dict)  # key -> ids named since

    def skipped(self, key: str | None, seq: int, claimed: tuple[str, ...]) -> tuple[str, ...]:
        """The gap a row of stream ``key`` at ``seq`` names: the one its claim read
        (``claimed``, oldest first) and the rows of its stream the run abandoned before it,
        less what a row published in the run named already."""
        if key is None:
            return claimed
        opened, closed = self._opened.get(key), self._closed.get(key)
        if opened is None and closed is None:  # nearly always: nothing changed in the run
            return claimed
        names = list(claimed)
        if opened:
            names += [mid for at, mid in sorted(opened.items()) if at < seq and mid not in names]
        if closed:
            names = [mid for mid in names if mid not in closed]
        return tuple(names)

    def abandoned(self, key: str | None, seq: int, message_id: str) -> None:
        """A row of stream ``key`` was abandoned: a gap for the rows after it to name."""
        if key is not None:
            self._opened.setdefault(key, {})[seq] = message_id

    def published(self, key: str | None, named: tuple[str, ...]) -> None:
        """A row of stream ``key`` that named ``named`` was published: they are closed."""
        if key is not None and named:
            self._closed.setdefault(key, set()).update(named)
