"""A database outage as the log tells it: one line when it starts, one when it ends.

The processors of a database and its watcher all retry while it is down, each on its own
back-off; a line per retry would bury everything else (and a dropped database is retried for
as long as the router runs). They share their store's ``Outage``: the first failure logs
``db.unavailable`` with a one-line reason, the first success after it logs ``db.recovered``
with how long it lasted, and the retries in between are logged at debug only.
"""

from __future__ import annotations

import logging
import time
from typing import Any

__all__ = ["Outage", "one_line"]

log = logging.getLogger(__name__)


def one_line(error: str) -> str:
    """The first line of a driver's message (PostgreSQL adds DETAIL and HINT lines)."""
    return error.strip().split("\n", 1)[0].strip()


class Outage:
    """Whether one database is down, as last seen by any user of its store."""

    def __init__(self, database: str) -> None:
        self.database = database
        self._since: float | None = None

    @property
    def down(self) -> bool:
        """True between a failure and the next success."""
        return self._since is not None

    def failed(self, error: str, **extra: Any) -> None:
        """A statement or a connect failed: logged at warning if the database was up."""
        fields = {"database": self.database, "error": one_line(error), **extra}
        if self._since is None:
            self._since = time.monotonic()
            log.warning("db.unavailable", extra=fields)
        else:
            log.debug("db.unavailable", extra=fields)

    def recovered(self) -> None:
        """A statement or a connect worked: logged at info if the database was down."""
        if self._since is None:
            return
        seconds = time.monotonic() - self._since
        self._since = None
        log.info("db.recovered", extra={"database": self.database, "after": f"{seconds:.1f}s"})
