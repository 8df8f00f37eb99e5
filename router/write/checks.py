"""What ``stage()`` refuses in values before any SQL runs, and the one database error it
explains: each check once, for the async and the sync writer alike.

- A float NaN or infinity anywhere in a payload or the extensions: JSON has none, and the
  serialisers (pydantic's, orjson) would write ``null``, the value lost.
- A datetime without a timezone there: it names no instant, and would go out without a zone,
  read differently by each consumer. Refused rather than guessed at (as UTC, say): the
  writer knows its zone, the router does not.
- A NUL character in a stream key, a staged header, or an id that travels as a transport
  header (correlation, causation, traceparent): PostgreSQL cannot store one in text, and
  broker headers cannot carry one. Refused on every database, so the same call stages on all.
- No router tables: a database ``router init-db`` never ran on. On PostgreSQL, asked before
  the first INSERT (``needs_schema_probe``, ``SCHEMA_PROBE``, ``check_schema_probe``), as a
  failed INSERT there would abort the caller's transaction; elsewhere, and on PostgreSQL
  should the tables go after that, the INSERT's error is explained (``missing_schema``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from decimal import Decimal
from typing import TYPE_CHECKING
from uuid import UUID

from pydantic import BaseModel

from envelopes import StagingError

if TYPE_CHECKING:
    from router.config import DatabaseSettings

__all__ = [
    "SCHEMA_PROBE",
    "check_no_nul",
    "check_schema_probe",
    "json_problem",
    "missing_schema",
    "needs_schema_probe",
]

# Types that are JSON as they are: most fields of most events stop at the first test.
_PLAIN: frozenset[type] = frozenset({str, int, bool, type(None), Decimal, UUID})


def json_problem(value: object, path: str) -> str | None:
    """The first place in ``value`` (called ``path``) that JSON cannot hold as it is, and
    why: a float NaN or infinity, a datetime without a timezone. None when there is none.

    It walks the values as they are held (models, mappings, sequences, dataclasses), after
    serialisation succeeded, so there is no cycle to fall into. A plain value costs a set
    lookup, and its path is made only for a value that is not plain.
    """
    if type(value) in _PLAIN:
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{path}: {_name(value)} is not valid JSON"
    if isinstance(value, datetime):
        if value.utcoffset() is not None:
            return None
        return (
            f"{path}: a datetime without a timezone is ambiguous; "
            "give it one, e.g. datetime.now(UTC)"
        )
    for key, child, form in _children(value):
        if type(child) not in _PLAIN:
            problem = json_problem(child, form.format(path, key))
            if problem is not None:
                return problem
    return None


def _children(value: object) -> Iterable[tuple[object, object, str]]:
    """The values inside a container: each one's key, the value, and its path's format."""
    if isinstance(value, BaseModel):
        fields = value.__dict__.items()
        extra = value.__pydantic_extra__
        items = [*fields, *extra.items()] if extra else fields
        return ((name, child, "{}.{}") for name, child in items)
    if isinstance(value, Mapping):
        return ((key, child, "{}[{!r}]") for key, child in value.items())
    if isinstance(value, Sequence | set | frozenset) and not isinstance(value, bytes | bytearray):
        return ((i, child, "{}[{}]") for i, child in enumerate(value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = [f.name for f in dataclasses.fields(value)]
        return ((name, getattr(value, name), "{}.{}") for name in names)
    return ()


def _name(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def check_no_nul(value: str | None, what: str) -> None:
    """Raise StagingError when ``value`` holds a NUL character."""
    if value is not None and "\x00" in value:
        raise StagingError(
            f"{what} {value!r} holds a NUL character (\\x00), which a database text column "
            "or a broker header cannot carry"
        )


# Whether PostgreSQL has the router's outbox table, named as the INSERT names it: unqualified,
# so resolved on the caller's search_path as the INSERT's name is. to_regclass answers NULL for
# a missing table where the INSERT fails, and a failed statement aborts PostgreSQL's whole
# transaction, the caller's own work with it, and nothing but a rollback ends that.
SCHEMA_PROBE = "SELECT to_regclass('router_outbox') IS NOT NULL"

# The databases this process has found the tables on, by configured URL: two URLs of one
# database cost a probe each, where a coarser key (host and name) could take a second server
# for the first and skip its probe. Only a yes is kept: after a no, `router init-db` may run
# while the application does.
_schema_found: set[str] = set()


def needs_schema_probe(dialect: str, database: DatabaseSettings) -> bool:
    """Whether stage() asks ``SCHEMA_PROBE`` before its INSERT: on PostgreSQL, until this
    process has found the tables on ``database`` once.

    One round trip, once per database per process. A SAVEPOINT around every stage() would
    keep the transaction usable too, but costs two round trips on each call to serve a
    mistake made once at setup: ``bench.stage_sync --driver psycopg --repeat 3`` put stage()
    at 1.26x (1.24-1.32) a hand INSERT with it against 1.12x (1.04-1.23) without.
    """
    return dialect == "postgresql" and database.url.get_secret_value() not in _schema_found


def check_schema_probe(present: object, database: DatabaseSettings, name: str) -> None:
    """Take ``SCHEMA_PROBE``'s answer on ``database`` (configured as ``name``): StagingError
    naming `router init-db` when the tables are not there, the caller's transaction
    untouched; else remember that they are."""
    if not present:
        raise StagingError(_no_tables(name, "router_outbox"))
    _schema_found.add(database.url.get_secret_value())


def missing_schema(error: BaseException, database: str, dialect: str) -> StagingError | None:
    """A StagingError saying what to do when ``error`` is the database's answer to a missing
    router table; None for any other error.

    MySQL and SQLite fail the statement alone, so there the transaction goes on. PostgreSQL
    aborts the caller's transaction: there the tables are asked for first
    (``needs_schema_probe``), so this explains an INSERT only on tables gone since they were
    found, and the message says that only a rollback ends the transaction.
    """
    table = _missing_table(error)
    if table is None:
        return None
    message = _no_tables(database, table)
    if dialect == "postgresql":
        message += "; PostgreSQL has aborted this transaction, so roll it back"
    return StagingError(message)


def _no_tables(database: str, table: str) -> str:
    return (
        f"database {database!r} has no table {table} (the router's tables are not "
        "there): run `router init-db`"
    )


_TABLES = ("router_outbox", "router_streams")


def _missing_table(error: BaseException) -> str | None:
    """The router table ``error`` says is missing, looking through the wrappers of SQLAlchemy
    (``.orig``) and Django (``__cause__``) to the driver's own error."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _says_undefined_table(current):
            text = str(current)
            return next((t for t in _TABLES if t in text), None)
        orig = getattr(current, "orig", None)
        current = orig if isinstance(orig, BaseException) else current.__cause__
    return None


def _says_undefined_table(error: BaseException) -> bool:
    # PostgreSQL's SQLSTATE 42P01 (asyncpg and psycopg: .sqlstate; psycopg2: .pgcode),
    # MySQL's error 1146 (first of the args of PyMySQL's, aiomysql's and asyncmy's errors),
    # SQLite's "no such table" (sqlite3 has no code for it before Python 3.11's).
    code = getattr(error, "sqlstate", None) or getattr(error, "pgcode", None)
    if code == "42P01":
        return True
    args = error.args
    if args and args[0] == 1146:
        return True
    return type(error).__name__ == "OperationalError" and str(error).startswith("no such table")
