"""How adapters put a client library's exception into an error message."""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from brokers._settings import BrokerSettings

__all__ = ["describe", "refused", "unreachable"]


def describe(exc: BaseException) -> str:
    """``Type: first line of the message`` (the type alone when the message says nothing)."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    name = type(exc).__name__
    return f"{name}: {first}" if first and first != name else name


def refused(exc: BaseException) -> bool:
    """True when ``exc``, or an exception it was raised from, is a refused connection.

    Client libraries wrap the socket's error in their own (redis-py's ``ConnectionError``,
    aiormq's ``AMQPConnectionError``), whose text differs by event loop.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ConnectionRefusedError) or (
            isinstance(current, OSError) and current.errno == errno.ECONNREFUSED
        ):
            return True
        current = current.__cause__ or current.__context__
    return False


def unreachable(exc: BaseException, settings: BrokerSettings) -> str:
    """Why a broker cannot be reached: a refused connection or a silence names where (the
    address without credentials); anything else is the client library's exception."""
    address = settings.public_url()
    where = f"{address}: " if address else ""
    if refused(exc):
        return f"{where}connection refused"
    if type(exc) is TimeoutError:  # our own limit ran out; the library said nothing
        return f"{where}no answer within {settings.connect_timeout:g} s"
    return describe(exc)
