"""The audit trail: one ``router_audit`` row per operator action (requeue, discard, pause,
resume), written in the action's own transaction so the two commit together or not at all.

``record`` writes a row in the caller's connection; ``history`` reads the trail back, newest
first, from every database (each database keeps the trail of the actions on its outbox).
"""

from __future__ import annotations

import getpass
import json
import socket
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from router.config import RouterConfig
from router.ops import connections
from router.ops.schema import audit
from router.ops.times import utc

__all__ = ["AuditRow", "cli_actor", "history", "record"]


@dataclass(frozen=True)
class AuditRow:
    """One operator action on one database."""

    database: str
    id: int
    at: str | None
    actor: str
    action: str
    target: str | None
    detail: dict[str, Any]
    row_count: int

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self)


def cli_actor() -> str:
    """Who runs a command-line action: ``user@host``."""
    return f"{getpass.getuser()}@{socket.gethostname()}"


async def record(
    conn: AsyncConnection,
    *,
    actor: str,
    action: str,
    target: str | None,
    detail: dict[str, Any],
    row_count: int,
) -> int:
    """Add one audit row in ``conn``'s transaction (``at``: now, in UTC); its id."""
    now = datetime.now(UTC)
    # MySQL's DATETIME takes no offset; the column holds UTC like every other stamp there.
    at = now.replace(tzinfo=None) if conn.dialect.name == "mysql" else now
    result = await conn.execute(
        sa.insert(audit).values(
            at=at,
            actor=actor,
            action=action,
            target=target,
            detail=json.dumps(detail, default=str, sort_keys=True),
            row_count=row_count,
        )
    )
    key = result.inserted_primary_key
    assert key is not None
    return int(key[0])


async def history(
    config: RouterConfig, database: str | None = None, limit: int = 50
) -> list[AuditRow]:
    """The latest ``limit`` actions over the databases asked for, newest first."""
    found: list[AuditRow] = []
    for name in connections.database_names(config, database):
        async with connections.connect(config, name) as conn:
            query = sa.select(audit).order_by(audit.c.at.desc(), audit.c.id.desc()).limit(limit)
            found.extend(_row(name, row, utc(row.at)) for row in (await conn.execute(query)))
    # Every ``at`` is UTC in one format: its text sorts as the time does.
    found.sort(key=lambda r: (r.at or "", r.id), reverse=True)
    return found[:limit]


def _row(database: str, row: Any, at: datetime | None) -> AuditRow:
    return AuditRow(
        database=database,
        id=int(row.id),
        at=at.isoformat(timespec="milliseconds") if at else None,
        actor=row.actor,
        action=row.action,
        target=row.target,
        detail=_detail(row.detail),
        row_count=int(row.row_count),
    )


def _detail(text: str | None) -> dict[str, Any]:
    """The stored detail (a JSON object's text); one that does not parse is kept under
    ``raw``."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {"raw": text}
    return value if isinstance(value, dict) else {"raw": text}
