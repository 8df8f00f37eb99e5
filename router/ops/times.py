"""Times as the databases hand them back, made comparable: aware, in UTC."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

__all__ = ["utc"]


def utc(value: Any) -> datetime | None:
    """SQLite hands times back as text or naive (they are stored in UTC)."""
    if value is None:
        return None
    moment: datetime = datetime.fromisoformat(value) if isinstance(value, str) else value
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)
