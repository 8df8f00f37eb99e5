"""The driver ``SyncOutbox.stage`` runs on Django's connection (``django.db.connection`` or
``connections[alias]``), inside ``transaction.atomic()``: its cursor takes ``%(name)s`` and
``%s`` on every backend.

``router.write.drivers.sync_driver`` imports it by name for a connection of Django's, so
neither Django nor this package is loaded for an application that stages on another.
Imports no Django: it works on the connection it is given.

A target with ``atomic: true`` publishes the rows of one transaction (the outermost
``transaction.atomic()`` block) as one unit; ``DjangoDriver.unit`` says which.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from envelopes import StagingError
from router.write.drivers import AUTOCOMMIT, dbapi_execute, in_pipeline, psycopg_execute
from router.write.statements import Copy, Statement
from router.write.units import Unit, transaction_unit

__all__ = ["DjangoDriver"]


class DjangoDriver:
    """Django's connection for one database alias, inside ``transaction.atomic()``."""

    _DIALECTS = {"postgresql": "postgresql", "mysql": "mysql", "sqlite": "sqlite"}

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        dialect = self._DIALECTS.get(connection.vendor)
        if dialect is None:
            raise StagingError(
                f"Django database {connection.alias!r} is {connection.vendor}; the outbox "
                "runs on PostgreSQL, MySQL/MariaDB and SQLite"
            )
        self.dialect = dialect
        if not connection.in_atomic_block:
            raise StagingError(
                AUTOCOMMIT.format(
                    what=f"Django's connection {connection.alias!r} is outside "
                    "transaction.atomic()",
                    fix="stage inside `with transaction.atomic():` (or ATOMIC_REQUESTS)",
                )
            )
        self._raw = self._psycopg()
        piped = self._raw is not None and in_pipeline(self._raw)
        self.copies = self._raw is not None and not piped
        # psycopg 3 as Django sets it up by default (prepare_threshold None), or psycopg2,
        # whose cursors Django's are: nothing is prepared.
        self.simple = dialect == "postgresql" and (
            self._raw is None or (self._raw.prepare_threshold is None and not piped)
        )

    def execute(self, statement: Statement | Copy) -> int:
        """Run one statement in the connection's transaction; the rows it wrote.

        On PostgreSQL with psycopg 3 it goes on a server-binding cursor of the connection
        Django holds, its arrays in binary: Django's own cursor binds on the client (unless
        ``server_side_binding``), quoting every array element into the SQL text, which made
        a stage() take 1.8x a plain prepared INSERT. Django's query log (``DEBUG``) and
        ``execute_wrapper``s do not see this statement; the transaction is the same.
        """
        if self._raw is not None:
            return psycopg_execute(self._raw, statement)
        return dbapi_execute(self.connection, statement)

    def scalar(self, sql: str) -> object:
        """The first value of ``sql``'s first row, on Django's cursor."""
        with self.connection.cursor() as cursor:
            cursor.execute(sql)
            return cursor.fetchone()[0]

    def unit(self) -> Unit:
        """The unit of the connection's outermost atomic block.

        Not the block's ``Atomic`` object: a view decorated with ``transaction.atomic``
        enters the same one on every request. The key is a no-op commit hook registered in
        the transaction, which lives exactly as long as it: its commit runs the hooks and
        drops them, its rollback drops them. Registered outside every savepoint (no savepoint
        ids), so a savepoint rolled back keeps it, as the transaction goes on."""
        connection = self.connection
        hook = _hooks.get(connection)
        if hook is None or not any(entry[1] is hook for entry in connection.run_on_commit):
            hook = _hooks[connection] = _noop()
            connection.on_commit(hook)
            connection.run_on_commit[-1][0].clear()  # its savepoint ids: none
        return transaction_unit(hook)

    def _psycopg(self) -> Any:
        """The psycopg 3 connection under Django's PostgreSQL one, or None."""
        if self.dialect != "postgresql":
            return None
        self.connection.ensure_connection()
        raw = self.connection.connection
        return raw if type(raw).__module__.partition(".")[0] == "psycopg" else None


# Per Django connection (one per alias and thread), the commit hook that stands for its open
# transaction (``DjangoDriver.unit``).
_hooks: weakref.WeakKeyDictionary[Any, Callable[[], None]] = weakref.WeakKeyDictionary()


def _noop() -> Callable[[], None]:
    """A new function object that does nothing: a transaction's key."""

    def hook() -> None:
        return None

    return hook
