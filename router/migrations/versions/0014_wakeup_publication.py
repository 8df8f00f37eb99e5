"""PostgreSQL: a publication of new queue rows, for the relay to follow the database's log.

With ``wakeup: log`` (or ``auto`` where the server allows it) the relay learns of commits from
PostgreSQL's logical decoding instead of ``NOTIFY`` (router/relay/store/postgres_wal.py): a
temporary replication slot streams, through this publication, the ``seq`` and ``target`` of
every row inserted into the outbox's queue. Only the queue (``router_outbox_queue``, migration
0011): marking a row published moves it into ``router_outbox_done``, which logical decoding
reports as an insert there, and would wake the relay after every batch it marks; a row
requeued from the history moves the other way and is an insert worth waking for. Changes are
published as the queue's, not its slots' (``publish_via_partition_root``), so slots can come
and go. Only inserts: an update or a delete never makes a row due that was not.

A column list (PostgreSQL 15 and later) keeps the rest of each row (its envelope) out of the
stream; older servers send whole rows, which the relay reads past. The publication costs
nothing while no slot reads it: it is made on every PostgreSQL database, whatever its
``wal_level``, so that turning logical decoding on later needs no migration. SQLite and
MariaDB are untouched.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-25
"""

from __future__ import annotations

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

# Literal copies (migrations are history and load nothing of the project; the name the relay
# looks for is router.relay.store.postgres_wal.PUBLICATION).
PUBLICATION = (
    "CREATE PUBLICATION router_wakeup FOR TABLE router_outbox_queue {columns}"
    "WITH (publish = 'insert', publish_via_partition_root = true)"
)
COLUMNS = "(seq, target) "


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    version = bind.exec_driver_sql("SHOW server_version_num").scalar()
    columns = COLUMNS if int(str(version)) >= 150000 else ""
    op.execute(PUBLICATION.format(columns=columns))


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP PUBLICATION IF EXISTS router_wakeup")
