"""Counters a processor keeps since it started."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ProcessorStats"]


@dataclass(slots=True)
class ProcessorStats:
    """Counters since the processor started."""

    published: int = 0
    failed: int = 0
    abandoned: int = 0
    batches: int = 0
    last_error: str | None = None
