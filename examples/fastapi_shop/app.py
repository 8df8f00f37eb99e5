"""A FastAPI shop that writes its orders and stages their events in one async transaction.

    python -m fastapi_shop.app create-tables
    uvicorn fastapi_shop.app:app                    # and `router serve` beside it

SQLAlchemy's ``AsyncSession`` on the outbox's engine (asyncpg), one per request from a
dependency that yields it inside ``session.begin()``: the handler's rows and events commit
together after it returns, before the response is sent, or roll back if it raises.

- ``POST /orders`` stages ``OrderPlaced`` explicitly: ``await outbox.stage(session, ...)``.
- ``POST /orders/{id}/pay`` stages nothing itself: the ``Order`` entity raises ``OrderPaid``
  and ``outbox.stage_on_flush(sessions)`` stages it when the session flushes at commit.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Annotated

import sqlalchemy as sa
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from router import Outbox, RaisesEvents

from .events import OrderPaid, OrderPlaced

CONFIG = Path(__file__).with_name("config.yaml")


class Base(DeclarativeBase):
    """The shop's tables."""


class Order(Base, RaisesEvents):
    """An order; paying it raises ``OrderPaid``."""

    __tablename__ = "orders"

    id: Mapped[str] = mapped_column(sa.String(36), primary_key=True)
    customer: Mapped[str]
    total: Mapped[Decimal] = mapped_column(sa.Numeric(12, 2))
    status: Mapped[str] = mapped_column(sa.String(16), default="placed")

    def pay(self) -> None:
        """Mark the order paid and raise ``OrderPaid`` (staged at the next flush)."""
        self.status = "paid"
        self.raise_event(OrderPaid(order_id=self.id, total=self.total))


class CheckoutFailed(Exception):
    """A step after staging failed; the order and its event roll back together."""


@dataclass(frozen=True)
class Shop:
    """What the handlers share: the outbox and the sessions on its engine."""

    outbox: Outbox
    sessions: async_sessionmaker[AsyncSession]


def open_shop() -> Shop:
    """The outbox from ``$ROUTER_CONFIG`` (else the ``config.yaml`` beside this file), and
    sessions on its engine for the configured database (``$DATABASE_URL``)."""
    outbox = Outbox.from_file(os.environ.get("ROUTER_CONFIG", CONFIG))
    sessions = async_sessionmaker(outbox.engine(), expire_on_commit=False)
    outbox.stage_on_flush(sessions)  # Order.raise_event(...) -> staged at flush
    return Shop(outbox, sessions)


def get_shop(request: Request) -> Shop:
    """The app's ``Shop`` (opened by its lifespan)."""
    shop: Shop = request.app.state.shop
    return shop


async def transaction(shop: Annotated[Shop, Depends(get_shop)]) -> AsyncIterator[AsyncSession]:
    """A session in a transaction: committed when the handler returns, rolled back if it
    raises."""
    async with shop.sessions() as session, session.begin():
        yield session


ShopDep = Annotated[Shop, Depends(get_shop)]
# scope="function": the commit runs before the response is sent, so a client never sees a
# success that did not commit (FastAPI's default exits a yield dependency after sending).
SessionDep = Annotated[AsyncSession, Depends(transaction, scope="function")]


class NewOrder(BaseModel):
    """The body of ``POST /orders``."""

    customer: str
    total: Decimal
    fail_after_stage: bool = False  # raise after staging: nothing is committed, nothing sent


class OrderOut(BaseModel):
    """An order's id and status."""

    id: str
    status: str


orders = APIRouter()


@orders.post("/orders", status_code=201)
async def place_order(new: NewOrder, session: SessionDep, shop: ShopDep) -> OrderOut:
    """Write an order and stage ``OrderPlaced`` in the same transaction."""
    order_id = str(uuid.uuid4())
    session.add(Order(id=order_id, customer=new.customer, total=new.total))
    await shop.outbox.stage(
        session,
        OrderPlaced(order_id=order_id, customer=new.customer, total=new.total),
        stream_key=order_id,
    )
    if new.fail_after_stage:
        raise CheckoutFailed(f"order {order_id} failed after staging")
    return OrderOut(id=order_id, status="placed")


@orders.post("/orders/{order_id}/pay")
async def pay_order(order_id: str, session: SessionDep) -> OrderOut:
    """Pay an order; the entity's ``OrderPaid`` is staged when the session commits."""
    order = await session.get(Order, order_id, with_for_update=True)
    if order is None:
        raise HTTPException(404, f"no order {order_id}")
    if order.status == "paid":
        raise HTTPException(409, f"order {order_id} is paid already")
    order.pay()
    return OrderOut(id=order_id, status="paid")


async def checkout_failed(_: Request, error: Exception) -> JSONResponse:
    """A failed checkout, as JSON."""
    return JSONResponse({"error": str(error)}, status_code=500)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Open the shop on the server's event loop; dispose its engine at shutdown."""
    app.state.shop = shop = open_shop()
    yield
    await shop.outbox.close()


def create_app() -> FastAPI:
    """The app (its database is opened when it starts)."""
    app = FastAPI(title="FastAPI shop", lifespan=lifespan)
    app.include_router(orders)
    app.add_exception_handler(CheckoutFailed, checkout_failed)
    return app


app = create_app()


async def create_tables() -> None:
    """Create the shop's tables (``router init-db`` creates the outbox's)."""
    shop = open_shop()
    try:
        async with shop.outbox.engine().begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
    finally:
        await shop.outbox.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="The FastAPI shop's commands.")
    parser.add_argument("command", choices=["create-tables"])
    parser.parse_args()
    asyncio.run(create_tables())
    print("created the shop's tables")
