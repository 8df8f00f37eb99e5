"""Which application transaction a ``stage()`` call is in, for targets with ``atomic: true``.

An atomic target publishes the rows one transaction staged for it as one unit, and refuses at
``stage()`` a unit larger than its broker's atomic write (``BrokerSettings.max_unit``).

- PostgreSQL records each row's transaction itself (the ``xid`` column's default): nothing is
  written for it here. Only the size is checked: from the rows this client staged in the
  transaction (a ``Unit``), or, where the client cannot tell transactions apart (a raw
  psycopg, psycopg2 or asyncpg connection), by counting the transaction's rows of the target
  (``unit_count``, served by the unit index).
- MySQL/MariaDB and SQLite record nothing of the kind: the client draws a random 63-bit token
  per transaction and writes it in the ``xid`` column of the atomic targets' rows (NULL in
  the others'). A transaction is the root transaction of a SQLAlchemy ``Connection`` (a
  ``Session``'s, an ``AsyncConnection``'s, ``outbox.transaction()``'s), or the outermost
  ``transaction.atomic()`` block of a Django connection. A raw sqlite3 connection shows no
  transaction that can be told from the next: there each ``stage()`` call is a unit of its
  own.

Nothing here runs for a call without a row of an atomic target.
"""

from __future__ import annotations

import secrets
import weakref
from collections import Counter
from collections.abc import Mapping, Sequence

from envelopes import StagingError
from router._schema import OUTBOX_QUEUE
from router.write.statements import Row

__all__ = [
    "Unit",
    "atomic_targets",
    "check_unit_sizes",
    "join_unit",
    "transaction_unit",
    "unit_count",
]


class Unit:
    """One application transaction as the client sees it: its token, and the rows it staged
    so far per atomic target."""

    __slots__ = ("staged", "token")

    def __init__(self) -> None:
        self.token = secrets.randbits(63)
        self.staged: Counter[str] = Counter()


_units: weakref.WeakKeyDictionary[object, Unit] = weakref.WeakKeyDictionary()


def transaction_unit(transaction: object) -> Unit:
    """The unit of ``transaction`` (a SQLAlchemy ``RootTransaction``, or any object that
    lives exactly as long as one transaction), made on first use, gone with it."""
    unit = _units.get(transaction)
    if unit is None:
        unit = _units[transaction] = Unit()
    return unit


def unit_count(target: str) -> str:
    """On PostgreSQL: how many rows of ``target`` the current transaction staged, one dive
    into ix_router_outbox_unit (its predicate, word for word). ``target`` is a broker's name
    from the config, quoted here: the drivers' ``scalar`` takes no parameters."""
    quoted = target.replace("'", "''")
    return (
        f"SELECT count(*) FROM {OUTBOX_QUEUE} WHERE target = '{quoted}'"
        " AND xid = pg_current_xact_id()"
        " AND status IN ('pending', 'failed', 'held', 'parked')"
    )


def check_unit_sizes(
    rows: Sequence[Row], limits: Mapping[str, int], staged: Mapping[str, int]
) -> Counter[str]:
    """The rows of ``rows`` per atomic target (``limits``: each one's most); ``StagingError``
    naming the first target whose unit would pass its limit, with ``staged`` rows of it in the
    transaction already."""
    adding = Counter(row.target for row in rows if row.target in limits)
    for target, count in adding.items():
        total = staged.get(target, 0) + count
        if total > limits[target]:
            raise StagingError(
                f"this transaction would stage {total:,} rows for broker {target!r}, which has "
                f"atomic: true: its transaction's rows are one atomic unit, and a unit holds at "
                f"most {limits[target]:,} messages there; stage them in smaller transactions "
                f"(or leave atomic off)"
            )
    return adding


def atomic_targets(rows: Sequence[Row], limits: Mapping[str, int]) -> set[str]:
    """The atomic targets (``limits``) that ``rows`` go to: empty for most calls."""
    return {row.target for row in rows if row.target in limits} if limits else set()


def join_unit(
    rows: Sequence[Row],
    limits: Mapping[str, int],
    unit: Unit | None,
    staged: Mapping[str, int],
    *,
    tokens: bool,
) -> Counter[str]:
    """Check that ``rows`` keep each atomic target's unit within its limit (``staged``: its
    rows in the transaction so far), and give the rows of atomic targets ``unit``'s token
    where the database needs one (``tokens``: not PostgreSQL). The rows added per target,
    for ``unit.staged`` once they are written."""
    adding = check_unit_sizes(rows, limits, staged)
    if tokens and unit is not None:
        for row in rows:
            if row.target in limits:
                row.xid = unit.token
    return adding
