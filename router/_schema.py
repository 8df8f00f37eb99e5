"""The names of the database objects the router's SQL refers to: tables, partitions, indexes,
the sequence, functions and the publication, each written once.

The migrations (``router/migrations/versions/``) create these objects and keep their own
literal names: a migration is the schema as it was at its revision, so it must not follow a
later rename. Every other module names the objects through this one; renaming one is a new
migration and a change here. tests/unit/test_schema_names.py fails on a literal anywhere else
in the code (docstrings and comments may name them).

A root module of ``router``: it imports nothing, so every layer may use it.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "AUDIT",
    "FN_CLAIM",
    "FN_MARK",
    "GAPS",
    "INBOX",
    "IX_OUTBOX_CLAIM",
    "IX_OUTBOX_DUE",
    "IX_OUTBOX_PUBLISHED",
    "IX_OUTBOX_STREAM",
    "IX_OUTBOX_UNIT",
    "OUTBOX",
    "OUTBOX_DONE",
    "OUTBOX_QUEUE",
    "OUTBOX_SEQ",
    "QUEUE_SLOT_PREFIX",
    "RING",
    "STREAMS",
    "TARGETS",
    "VERSION_TABLE",
    "WAKEUP_PUBLICATION",
    "queue_slot",
    "queue_slot_index",
]

# Tables and partitions.

OUTBOX: Final = "router_outbox"
"""The outbox: one row per event and target; on PostgreSQL partitioned (migration 0011)."""

OUTBOX_QUEUE: Final = "router_outbox_queue"
"""PostgreSQL's partition of the outbox with the unfinished rows, split into the ring's slots."""

OUTBOX_DONE: Final = "router_outbox_done"
"""PostgreSQL's partition of the outbox with the published and abandoned rows (the history)."""

QUEUE_SLOT_PREFIX: Final = "router_outbox_q"
"""A ring slot's partition name before the slot's number, for SQL that appends the number."""

OUTBOX_SEQ: Final = "router_outbox_seq_seq"
"""PostgreSQL's sequence behind the outbox's ``seq`` identity column."""

STREAMS: Final = "router_streams"
"""MySQL/MariaDB's stream-key lock rows, one per lock slot (migration 0015)."""

GAPS: Final = "router_gaps"
"""The gap markers: per target and stream key, the rows abandoned and not yet named by a later
row delivered on that stream (migration 0016)."""

TARGETS: Final = "router_targets"
"""One row per target the router keeps state for: whether it is paused, and its circuit."""

RING: Final = "router_ring"
"""PostgreSQL's one-row table with the ring's gate (``gate_until``), which claims read."""

INBOX: Final = "router_inbox"
"""The consumers' dedup records (``router.write.inbox.Inbox``), one per consumer and message."""

AUDIT: Final = "router_audit"
"""The audit trail: one row per operator action (requeue, discard, pause, ...)."""

VERSION_TABLE: Final = "router_alembic_version"
"""Alembic's revision of the router's schema, apart from an application's ``alembic_version``."""

# Indexes: on the queue partition on PostgreSQL (each slot's partition has its own, see
# queue_slot_index), on the outbox itself on MySQL/MariaDB and SQLite.

IX_OUTBOX_CLAIM: Final = "ix_router_outbox_claim"
"""The claim's index of queued rows, by target and seq (with status on MySQL/MariaDB)."""

IX_OUTBOX_STREAM: Final = "ix_router_outbox_stream"
"""The index of rows by target and stream key, for the check that streams stay in order."""

IX_OUTBOX_DUE: Final = "ix_router_outbox_due"
"""The index of rows by target and due time (``available_at``), for the next retry."""

IX_OUTBOX_UNIT: Final = "ix_router_outbox_unit"
"""The index of rows by target and transaction (``xid``), for an atomic target's units."""

IX_OUTBOX_PUBLISHED: Final = "ix_router_outbox_published"
"""The retention index of published rows by ``published_at`` (led by status on MySQL)."""

# PostgreSQL's functions and publication.

FN_CLAIM: Final = "router_claim"
"""PostgreSQL's claim function (``router.relay.store.postgres_sql.CLAIM_FUNCTION``)."""

FN_MARK: Final = "router_mark"
"""PostgreSQL's function that writes a batch's outcomes (``postgres_sql.MARK_FUNCTION``)."""

WAKEUP_PUBLICATION: Final = "router_wakeup"
"""PostgreSQL's publication of the queue's inserts, for wake-ups from the log (migration 0014)."""


def queue_slot(slot: int | str) -> str:
    """The partition of ring slot ``slot`` of the queue (``router_outbox_q3``); ``slot`` may
    be text standing for a number, such as the pattern ``\\d``."""
    return f"{QUEUE_SLOT_PREFIX}{slot}"


def queue_slot_index(index: str, slot: int | str) -> str:
    """The partition of the queue's index ``index`` on ring slot ``slot``'s partition
    (``ix_router_outbox_claim_q3``); ``slot`` as ``queue_slot`` takes it."""
    return f"{index}_q{slot}"
