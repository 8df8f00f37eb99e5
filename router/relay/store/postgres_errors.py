"""What asyncpg raises when PostgreSQL cannot be used right now, for the store and its upkeep.

Everything else (a bug, a cancellation) is left to propagate.
"""

from __future__ import annotations

import asyncpg

__all__ = ["DB_ERRORS"]

# TargetServerAttributeNotMatched: every host of a multi-host URL answered, none accepts
# writes (mid-failover: the primary is down, the standby not promoted yet).
# InternalClientError: what asyncpg may raise instead of a lost connection when the server
# ends a session mid-operation (a dropped database, pg_terminate_backend; MagicStack/asyncpg
# #1069): the connection is gone as surely.
DB_ERRORS = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    asyncpg.TargetServerAttributeNotMatched,
    OSError,
    TimeoutError,
)
