"""The Flask shop's events. ``config.yaml`` lists this module under ``events:``, so
``router serve``, ``router preview`` and ``router contract`` know them."""

from __future__ import annotations

from decimal import Decimal

from pydantic import Field

from router import Event


class OrderPlaced(Event, type="order_placed", version=1):
    """A customer placed an order."""

    order_id: str = Field(examples=["7c3fb8ef-bb1a-49f7-a3c3-00d539e5fb6e"])
    customer: str = Field(examples=["ada@example.com"])
    total: Decimal = Field(examples=[Decimal("42.50")])


class OrderPaid(Event, type="order_paid", version=1):
    """An order was paid (raised by the ``Order`` entity, staged when its session flushes)."""

    order_id: str = Field(examples=["7c3fb8ef-bb1a-49f7-a3c3-00d539e5fb6e"])
    total: Decimal = Field(examples=[Decimal("42.50")])
