"""A tiny shop: one transaction writes an order row and stages its events.

    python examples/shop/app.py            # uses ./config.yaml (or $ROUTER_CONFIG)

The events are declared in ``events.py``. ``OrderPlaced`` is published: the internal broker
gets it in the full envelope and the ``partners`` broker in the external one.
``StockReserved`` is internal only.
"""

from __future__ import annotations

import argparse
import asyncio
import uuid
from decimal import Decimal

from events import OrderPlaced, StockReserved  # examples/shop/events.py, beside this file
from sqlalchemy import text

from router import Outbox, correlation

CREATE_ORDERS = """
CREATE TABLE IF NOT EXISTS shop_orders (
    id VARCHAR(36) PRIMARY KEY,
    customer TEXT NOT NULL,
    total NUMERIC NOT NULL
)
"""


async def place_order(outbox: Outbox, customer: str, total: Decimal) -> str:
    """Write the order and its events in one transaction; return the order id."""
    order_id = str(uuid.uuid4())
    with correlation(f"checkout-{order_id[:8]}"):
        async with outbox.transaction() as tx:
            await tx.connection.execute(
                text("INSERT INTO shop_orders (id, customer, total) VALUES (:i, :c, :t)"),
                {"i": order_id, "c": customer, "t": str(total)},
            )
            await tx.stage(
                OrderPlaced(order_id=order_id, customer=customer, total=total),
                StockReserved(order_id=order_id, sku="SKU-42", quantity=1),
                stream_key=order_id,
                headers={"channel": "web"},
            )
    return order_id


async def main() -> None:
    """Place a few orders."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", default=None, help="config file (default ./config.yaml)")
    parser.add_argument("-n", "--orders", type=int, default=3)
    args = parser.parse_args()
    outbox = Outbox.from_file(args.config)
    try:
        async with outbox.engine().begin() as conn:
            await conn.execute(text(CREATE_ORDERS))
        for i in range(args.orders):
            order_id = await place_order(outbox, f"customer-{i}", Decimal("19.90") + i)
            print(f"placed order {order_id}: staged order_placed + stock_reserved")
    finally:
        await outbox.close()


if __name__ == "__main__":
    asyncio.run(main())
