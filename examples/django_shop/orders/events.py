"""The shop's events. No Django import here: ``router serve`` imports this module too
(``events:`` in config.yaml) and never sets Django up."""

from __future__ import annotations

from decimal import Decimal

from pydantic import Field

from router import Event


class OrderPlaced(Event, type="order_placed", version=1, published=True):
    """A customer placed an order."""

    order_id: str = Field(examples=["7c3fb8ef-bb1a-49f7-a3c3-00d539e5fb6e"])
    customer: str = Field(examples=["ada@example.com"])
    total: Decimal = Field(examples=[Decimal("42.50")])
