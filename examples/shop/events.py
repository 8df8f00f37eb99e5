"""The shop's events. ``config.yaml`` lists this module under ``events:``, so ``router
preview`` and ``router contract`` know them; ``app.py`` stages them."""

from __future__ import annotations

from decimal import Decimal

from pydantic import Field

from router import Event


class OrderPlaced(Event, type="order_placed", version=1, published=True):
    """A customer placed an order (partners may see this)."""

    order_id: str = Field(examples=["7c3fb8ef-bb1a-49f7-a3c3-00d539e5fb6e"])
    customer: str = Field(examples=["ada@example.com"])
    total: Decimal = Field(examples=[Decimal("42.50")])


class StockReserved(Event, type="stock_reserved"):
    """Stock was set aside for an order (internal only)."""

    order_id: str = Field(examples=["7c3fb8ef-bb1a-49f7-a3c3-00d539e5fb6e"])
    sku: str = Field(examples=["SKU-42"])
    quantity: int = Field(examples=[1])
