"""The router's tables as SQLAlchemy Core objects, for the operations commands (status,
requeue, trace, pause, cleanup), which run on PostgreSQL, SQLite and MySQL/MariaDB alike.

The migrations in ``router/migrations`` create the tables; these definitions only describe
them for queries (the hot path uses hand-written SQL in ``router/relay/store``).
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from router._schema import AUDIT, GAPS, INBOX, OUTBOX, TARGETS

__all__ = ["audit", "gaps", "inbox", "metadata", "outbox", "targets"]

metadata = sa.MetaData()

# Message ids are uuid on PostgreSQL and their 36-character text on SQLite and MySQL.
_MessageId = sa.String(36).with_variant(postgresql.UUID(as_uuid=False), "postgresql")
_Time = sa.DateTime(timezone=True)

outbox = sa.Table(
    OUTBOX,
    metadata,
    sa.Column("seq", sa.BigInteger, primary_key=True),
    sa.Column("message_id", _MessageId, nullable=False),
    sa.Column("target", sa.Text, nullable=False),
    sa.Column("destination", sa.Text, nullable=False),
    sa.Column("event_type", sa.Text, nullable=False),
    sa.Column("stream_key", sa.Text),
    # JSON on PostgreSQL; read and written here as its text, as the store does.
    sa.Column("envelope", sa.Text, nullable=False),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("available_at", _Time, nullable=False),
    sa.Column("locked_by", sa.Text),
    sa.Column("locked_until", _Time),
    sa.Column("lease_token", sa.BigInteger),
    sa.Column("last_error", sa.Text),
    sa.Column("created_at", _Time, nullable=False),
    sa.Column("published_at", _Time),
    sa.Column("last_attempt_at", _Time),
    sa.Column("first_attempt_at", _Time),
    sa.Column("receipt", sa.Text),
)

# The gap markers of streams whose head was abandoned (migration 0016): one row per abandoned
# row with a stream key, until a row published after it names it.
gaps = sa.Table(
    GAPS,
    metadata,
    sa.Column("target", sa.Text, primary_key=True),
    sa.Column("stream_key", sa.Text, primary_key=True),
    sa.Column("seq", sa.BigInteger, primary_key=True),
    sa.Column("message_id", _MessageId, nullable=False),
    sa.Column("abandoned_at", _Time, nullable=False),
)

audit = sa.Table(
    AUDIT,
    metadata,
    sa.Column("id", sa.BigInteger, primary_key=True),
    sa.Column("at", _Time, nullable=False),
    sa.Column("actor", sa.Text, nullable=False),
    sa.Column("action", sa.Text, nullable=False),
    sa.Column("target", sa.Text),
    sa.Column("detail", sa.Text),
    sa.Column("row_count", sa.Integer, nullable=False),
)

inbox = sa.Table(
    INBOX,
    metadata,
    sa.Column("consumer", sa.Text, primary_key=True),
    sa.Column("message_id", sa.Text, primary_key=True),
    sa.Column("received_at", _Time, nullable=False),
)

targets = sa.Table(
    TARGETS,
    metadata,
    sa.Column("target", sa.Text, primary_key=True),
    sa.Column("paused", sa.Boolean, nullable=False),
    sa.Column("paused_at", _Time),
    sa.Column("paused_by", sa.Text),
    sa.Column("circuit", sa.Text, nullable=False),
    sa.Column("circuit_since", _Time),
    sa.Column("circuit_worker", sa.Text),
    sa.Column("circuit_error", sa.Text),
)
