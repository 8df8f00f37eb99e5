"""MySQL and MariaDB: stream keys lock one of 1,024 rows of ``router_streams``.

Until this revision ``stage()`` locked a row per stream key: an upsert of the key into
``router_streams``, then the INSERT of the outbox rows, two round trips in the caller's
transaction and a new row for every key ever staged (an order id as the key: a row per
order, kept forever). From this revision the table holds one row per lock slot, ``'0'`` to
``'1023'``, and a key locks the row of its slot, ``crc32(key) & 1023``
(router/write/mysql.py): with one key per call, the lock and the INSERT are one statement.
PostgreSQL has locked ``hashtext(key) & 1023`` since the same change; SQLite is untouched.

The rows of old keys go (``TRUNCATE``, at once however many there are) and the slots' rows
come in their place. Writers of an older version lock their keys' rows, and writers of this
one the slots': while both stage on one database, order per key holds within each version
only, so upgrade the writers of a database together.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-28
"""

from __future__ import annotations

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

SLOTS = 1024  # a literal copy of router.write.mysql.STREAM_SLOTS: migrations load nothing


def upgrade() -> None:
    if op.get_bind().dialect.name != "mysql":
        return
    op.execute("TRUNCATE TABLE router_streams")
    values = ", ".join(f"('{slot}')" for slot in range(SLOTS))
    op.execute(f"INSERT INTO router_streams (stream_key) VALUES {values}")


def downgrade() -> None:
    if op.get_bind().dialect.name != "mysql":
        return
    # Older writers upsert each key's row as they stage: an empty table is where they start.
    op.execute("TRUNCATE TABLE router_streams")
