"""What asyncpg raises when PostgreSQL cannot be used right now, for the store and its upkeep.

Everything else (a bug, a cancellation) is left to propagate.
"""

from __future__ import annotations

import asyncpg

__all__ = ["DB_ERRORS"]

# TargetServerAttributeNotMatched: every host of a multi-host URL answered, none accepts
# writes (mid-failover: the primary is down, the standby not promoted yet).
DB_ERRORS = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.TargetServerAttributeNotMatched,
    OSError,
    TimeoutError,
)
