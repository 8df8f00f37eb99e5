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
- No router tables (``missing_schema``): a database ``router init-db`` never ran on.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from decimal import Decimal
from uuid import UUID

from pydantic import BaseModel

from envelopes import StagingError

__all__ = ["check_no_nul", "json_problem", "missing_schema"]

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


def missing_schema(error: BaseException, database: str, dialect: str) -> StagingError | None:
    """A StagingError saying what to do when ``error`` is the database's answer to a missing
    router table; None for any other error.

    On PostgreSQL the failed statement has aborted the caller's transaction: only a rollback
    ends it, and the message says so. MySQL and SQLite fail the statement alone, so there the
    transaction goes on. A SAVEPOINT around every stage() would keep PostgreSQL's usable too,
    but it costs two round trips on each call to serve a mistake made once at setup:
    ``bench.stage_sync --driver psycopg --repeat 3`` put stage() at 1.26x (1.24-1.32) a hand
    INSERT with it against 1.12x (1.04-1.23) without, one event, one target; far over the
    3% such a check may cost. So the error is caught and explained instead.
    """
    table = _missing_table(error)
    if table is None:
        return None
    message = (
        f"database {database!r} has no table {table} (the router's tables are not "
        "there): run `router init-db`"
    )
    if dialect == "postgresql":
        message += "; PostgreSQL has aborted this transaction, so roll it back"
    return StagingError(message)


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
