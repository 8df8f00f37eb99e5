"""How a commit wakes the relay on PostgreSQL: the names stagers and relays share.

A stager (``router/write/postgres.py``) notifies ``CHANNEL`` only while a relay is idle and
listening, which a relay shows by holding its target's wake lock (``WAKE_LOCK_NAMESPACE``,
``hashtext(target)``); ``router/relay/store/postgres_wake.py`` has the relay's half and why it
cannot miss a commit. docs/architecture.md ("Waking the relay") draws the whole protocol.
"""

from __future__ import annotations

from router._schema import OUTBOX

__all__ = ["CHANNEL", "WAKE_LOCK_NAMESPACE"]

# A channel, not the table: it only carries the table's name, as stagers and relays have
# always used it. It follows the table on purpose: a rename of the table is a new migration
# every stager and relay must run on before they can reach the rows at all, so they agree on
# the new channel as they agree on the new table, and no separate literal can drift from it.
CHANNEL = OUTBOX
"""The LISTEN/NOTIFY channel; a notification's payload names the targets (``a,b``)."""

WAKE_LOCK_NAMESPACE = 1869903205
"""First key of the wake lock an idle relay holds per target (the second is the target's
``hashtext``); stagers try it shared."""
