"""Event classes shared by the integration tests."""

from __future__ import annotations

from decimal import Decimal

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
