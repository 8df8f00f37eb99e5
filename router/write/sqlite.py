"""The statements ``stage()`` runs on SQLite: one INSERT of up to 1,000 rows. SQLite has one
writer at a time, so per-stream order needs no lock, and its relay watches the database file
rather than waiting for a notification. The rows of atomic targets carry their transaction's
token in ``xid`` (``router.write.units``); a call without one leaves the column out."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from router._db import sqlite_time
from router._schema import OUTBOX
from router.write.statements import Row, Statement

__all__ = ["SqliteStatements"]

_COLUMNS = "message_id, target, destination, event_type, stream_key, envelope"
_FIELDS = ("m", "t", "d", "e", "k", "v", "a", "c")
_FIELDS_XID = (*_FIELDS, "x")
_MAX_ROWS = 1000  # stays far below SQLite's 32,766 bound variables


class SqliteStatements:
    """The statements of ``stage()`` calls on SQLite, with each row count's text kept."""

    def __init__(self) -> None:
        self._inserts: dict[tuple[int, bool], str] = {}

    def statements(self, rows: Sequence[Row]) -> list[Statement]:
        """The statements that insert ``rows`` in order."""
        stamp = sqlite_time(datetime.now(UTC))
        xid = any(row.xid is not None for row in rows)
        fields = _FIELDS_XID if xid else _FIELDS
        statements = []
        for start in range(0, len(rows), _MAX_ROWS):
            chunk = rows[start : start + _MAX_ROWS]
            params: dict[str, Any] = {}
            for i, row in enumerate(chunk):
                values = (
                    row.message_id,
                    row.target,
                    row.destination,
                    row.event_type,
                    row.stream_key,
                    row.envelope,
                    stamp,
                    stamp,
                    row.xid,
                )
                params.update({f"{f}{i}": v for f, v in zip(fields, values, strict=False)})
            statements.append(Statement(self._insert(len(chunk), xid), params))
        return statements

    def _insert(self, count: int, xid: bool) -> str:
        statement = self._inserts.get((count, xid))
        if statement is None:
            fields = _FIELDS_XID if xid else _FIELDS
            values = ", ".join(
                "(" + ", ".join(f":{f}{i}" for f in fields) + ")" for i in range(count)
            )
            columns = f"{_COLUMNS}, available_at, created_at" + (", xid" if xid else "")
            statement = f"INSERT INTO {OUTBOX} ({columns}) VALUES {values}"
            if len(self._inserts) < 256:
                self._inserts[count, xid] = statement
        return statement
