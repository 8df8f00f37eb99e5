"""Event classes shared by the integration tests, and input stage() refuses."""

from __future__ import annotations

import math
import re
from datetime import datetime
from decimal import Decimal
from typing import Any

from router import Event


class OrderPlaced(Event, type="order_placed", version=2, published=True):
    """Published: goes to the internal broker and to partners."""

    order_id: str
    total: Decimal
    note: str | None = None


class StockReserved(Event, type="stock_reserved"):
    """Internal only."""

    order_id: str
    quantity: int


class Measured(Event, type="measured", published=True):
    """Published, with the value types JSON cannot always hold as given."""

    reading: float = 0.0
    taken_at: datetime | None = None


# An internal NATS broker (staging checks its header names; nothing connects to it) and a
# memory partner.
NATS_BROKERS: dict[str, Any] = {
    "events": {"type": "nats", "internal": True, "stream": {"name": "EVENTS", "subjects": [">"]}},
    "analytics": {"type": "memory"},
}

_NUL = "holds a NUL character (\\x00), which a database text column or a broker header cannot carry"
_NATS_NAME = (
    "a NATS header name takes only ASCII letters, digits and !#$%&'*+-.^_`|~ (no spaces, no ':')"
)

REFUSED_INPUT: list[tuple[list[Event], dict[str, Any], str]] = [
    (
        [Measured(reading=math.nan)],
        {},
        "event 'measured' cannot be serialised: payload.reading: NaN is not valid JSON",
    ),
    (
        [Measured(reading=-math.inf)],
        {},
        "event 'measured' cannot be serialised: payload.reading: -Infinity is not valid JSON",
    ),
    (
        [Measured(taken_at=datetime(2026, 1, 2, 3, 4, 5))],
        {},
        "event 'measured' cannot be serialised: payload.taken_at: a datetime without a timezone "
        "is ambiguous; give it one, e.g. datetime.now(UTC)",
    ),
    (
        [StockReserved(order_id="o", quantity=1)],
        {"stream_key": "o\x001"},
        f"stream_key 'o\\x001' {_NUL}",
    ),
    (
        [StockReserved(order_id="o", quantity=1)],
        {"headers": {"tenant": "acme\x00"}},
        f"header 'tenant' value 'acme\\x00' {_NUL}",
    ),
    (
        [StockReserved(order_id="o", quantity=1)],
        {"correlation_id": "req\x00"},
        f"correlation_id 'req\\x00' {_NUL}",
    ),
    (
        [StockReserved(order_id="o", quantity=1)],
        {"headers": {"bad name": "x"}},
        f"header 'bad name' cannot go to broker 'events' (nats): {_NATS_NAME}",
    ),
    (
        [StockReserved(order_id="o", quantity=1)],
        {"headers": {"a:b": "x"}},
        f"header 'a:b' cannot go to broker 'events' (nats): {_NATS_NAME}",
    ),
]
"""Input ``stage()`` refuses before any SQL: the events, the keywords, the exact message
(staged on ``NATS_BROKERS``). A test stages them all in one transaction, which must still
commit the caller's own rows afterwards."""

NO_TABLES = (
    "database 'main' has no table router_outbox (the router's tables are not there): "
    "run `router init-db`"
)
PG_ABORTED = "; PostgreSQL has aborted this transaction, so roll it back"


def not_granted(kind: str, account: str) -> str:
    """What stage() says to a role (PostgreSQL) or user (MariaDB, ``'name'@'host'`` as it
    connected) that may not write the router's tables."""
    if kind == "postgresql":
        return (
            f"database 'main': role {account} may not insert into router_outbox: "
            f"run `GRANT INSERT ON router_outbox TO {account}` as the table's owner"
        )
    return (
        f"database 'main': user {account} may not write the router's tables: run "
        "`GRANT INSERT ON router_outbox TO <account>` and "
        "`GRANT SELECT, INSERT, UPDATE ON router_streams TO <account>` in that database, "
        "as an administrator (<account>: the connection's CURRENT_USER())"
    )


def grants_named(message: str, account: str) -> list[str]:
    """The GRANT statements a refusal names, for ``account``."""
    return [g.replace("<account>", account) for g in re.findall(r"`(GRANT [^`]*)`", message)]
