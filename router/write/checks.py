"""What ``stage()`` refuses in values before any SQL runs, and the database errors it
explains: each check once, for the async and the sync writer alike.

- A float NaN or infinity anywhere in a payload or the extensions: JSON has none, and the
  serialisers (pydantic's, orjson) would write ``null``, the value lost.
- A datetime without a timezone there: it names no instant, and would go out without a zone,
  read differently by each consumer. Refused rather than guessed at (as UTC, say): the
  writer knows its zone, the router does not.
- A NUL character in a stream key, a staged header, or an id that travels as a transport
  header (correlation, causation, traceparent): PostgreSQL cannot store one in text, and
  broker headers cannot carry one. Refused on every database, so the same call stages on all.
- No router tables (a database ``router init-db`` never ran on), or no grant to write them.
  On PostgreSQL, asked before the first INSERT (``needs_schema_probe``, ``SCHEMA_PROBE``,
  ``check_schema_probe``), as a failed INSERT there would abort the caller's transaction;
  elsewhere, and on PostgreSQL should the tables or the grant go after that, the INSERT's
  error is explained (``table_refusal``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from decimal import Decimal
from typing import TYPE_CHECKING
from uuid import UUID

from pydantic import BaseModel

from envelopes import StagingError
from router._schema import OUTBOX, STREAMS

if TYPE_CHECKING:
    from router.config import DatabaseSettings

__all__ = [
    "SCHEMA_PROBE",
    "check_no_nul",
    "check_schema_probe",
    "json_problem",
    "needs_schema_probe",
    "table_refusal",
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
    if isinstance(value, BaseModel):
        # Every event is a model, most of them holding plain values alone: one pass over
        # them. It looks at the values, not at the annotations, which cannot be trusted to
        # rule a value out: model_construct() and an assignment without validate_assignment
        # store anything, and the serialiser writes a NaN in a ``str`` field as null and a
        # naive datetime in an ``int`` field without a zone (with a warning), the very loss
        # this check is for.
        extra = value.__pydantic_extra__
        fields = value.__dict__.items()
        for name, child in [*fields, *extra.items()] if extra else fields:
            if type(child) not in _PLAIN:
                problem = json_problem(child, f"{path}.{name}")
                if problem is not None:
                    return problem
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
# so resolved on the caller's search_path as the INSERT's name is, and whether the caller's
# role may insert into it. A missing table or a missing grant fails the INSERT, and a failed
# statement aborts PostgreSQL's whole transaction, the caller's own work with it, and nothing
# but a rollback ends that. The one answer: NULL when the table is missing (to_regclass),
# '' when the role may insert, else the role's name as GRANT takes it. INSERT is all the
# statements need: seq is an identity column, whose sequence needs no grant of its own, and
# RETURNING 1 reads no column.
SCHEMA_PROBE = (
    f"SELECT CASE has_table_privilege(to_regclass('{OUTBOX}'), 'INSERT') "
    "WHEN true THEN '' WHEN false THEN quote_ident(current_user) END"
)

# The databases this process has found the tables on, by configured URL: two URLs of one
# database cost a probe each, where a coarser key (host and name) could take a second server
# for the first and skip its probe. Only a yes is kept: after a no, `router init-db` (or the
# GRANT) may run while the application does.
_schema_found: set[str] = set()


def needs_schema_probe(dialect: str, database: DatabaseSettings) -> bool:
    """Whether stage() asks ``SCHEMA_PROBE`` before its INSERT: on PostgreSQL, until this
    process has found the tables, granted, on ``database`` once.

    One round trip, once per database per process. A SAVEPOINT around every stage() would
    keep the transaction usable too, but costs two round trips on each call to serve a
    mistake made once at setup: ``bench.stage_sync --driver psycopg --repeat 3`` put stage()
    at 1.26x (1.24-1.32) a hand INSERT with it against 1.12x (1.04-1.23) without.
    """
    return dialect == "postgresql" and database.url.get_secret_value() not in _schema_found


def check_schema_probe(answer: object, database: DatabaseSettings, name: str) -> None:
    """Take ``SCHEMA_PROBE``'s answer on ``database`` (configured as ``name``): StagingError
    naming `router init-db` when the tables are not there, or the GRANT to run when the role
    may not insert, the caller's transaction untouched; else remember that all is well."""
    if answer is None:
        raise StagingError(_no_tables(name, OUTBOX))
    if answer:
        raise StagingError(_no_grant(name, "postgresql", str(answer)))
    _schema_found.add(database.url.get_secret_value())


def table_refusal(error: BaseException, database: str, dialect: str) -> StagingError | None:
    """A StagingError saying what to do when ``error`` is the database's refusal of a router
    table, missing or not granted to the caller; None for any other error.

    MySQL and SQLite fail the statement alone, so there the transaction goes on. PostgreSQL
    aborts the caller's transaction: there the tables and the grant are asked for first
    (``needs_schema_probe``), so this explains an INSERT only on tables gone (or a grant
    revoked) since they were found, and the message says that only a rollback ends the
    transaction.
    """
    message = next(filter(None, (_explain(e, database, dialect) for e in _chain(error))), None)
    if message is None:
        return None
    if dialect == "postgresql":
        message += "; PostgreSQL has aborted this transaction, so roll it back"
    return StagingError(message)


def _no_tables(database: str, table: str) -> str:
    return (
        f"database {database!r} has no table {table} (the router's tables are not "
        "there): run `router init-db`"
    )


def _no_grant(database: str, dialect: str, account: str | None) -> str:
    """What to GRANT so ``account`` (None: not known here) may stage on ``database``."""
    if dialect == "postgresql":
        who = f"role {account}" if account else "the connection's role"
        to = account or "<role> (its current_user)"
        return (
            f"database {database!r}: {who} may not insert into {OUTBOX}: "
            f"run `GRANT INSERT ON {OUTBOX} TO {to}` as the table's owner"
        )
    # router_streams: the upsert that locks the stream keys reads the key it updates.
    who = f"user {account}" if account else "the connection's user"
    return (
        f"database {database!r}: {who} may not write the router's tables: run "
        f"`GRANT INSERT ON {OUTBOX} TO <account>` and "
        f"`GRANT SELECT, INSERT, UPDATE ON {STREAMS} TO <account>` in that database, "
        "as an administrator (<account>: the connection's CURRENT_USER())"
    )


_TABLES = (OUTBOX, STREAMS)
_MYSQL_USER = re.compile(r"to user ('[^']*'@'[^']*')")


def _explain(error: BaseException, database: str, dialect: str) -> str | None:
    """What to do about ``error`` when it is about a router table; None if it is not."""
    text = str(error)
    table = next((t for t in _TABLES if t in text), None)
    if table is None:
        return None
    if _says_undefined_table(error):
        return _no_tables(database, table)
    if _says_not_granted(error):
        user = _MYSQL_USER.search(text)
        return _no_grant(database, dialect, user[1] if user else None)
    return None


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and the errors it wraps, through SQLAlchemy's (``.orig``) and Django's
    (``__cause__``) wrappers to the driver's own."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        orig = getattr(current, "orig", None)
        current = orig if isinstance(orig, BaseException) else current.__cause__


def _says_undefined_table(error: BaseException) -> bool:
    # PostgreSQL's SQLSTATE 42P01 (asyncpg and psycopg: .sqlstate; psycopg2: .pgcode),
    # MySQL's error 1146 (first of the args of PyMySQL's, aiomysql's and asyncmy's errors),
    # SQLite's "no such table" (sqlite3 has no code for it before Python 3.11's).
    if _sqlstate(error) == "42P01" or _mysql_code(error) == 1146:
        return True
    return type(error).__name__ == "OperationalError" and str(error).startswith("no such table")


def _says_not_granted(error: BaseException) -> bool:
    # PostgreSQL's insufficient_privilege (42501); MySQL's table (1142) and column (1143)
    # access denied.
    return _sqlstate(error) == "42501" or _mysql_code(error) in (1142, 1143)


def _sqlstate(error: BaseException) -> object:
    return getattr(error, "sqlstate", None) or getattr(error, "pgcode", None)


def _mysql_code(error: BaseException) -> object:
    return error.args[0] if error.args else None
