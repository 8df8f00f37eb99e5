"""A Flask shop that writes its orders and stages their events in one sync transaction.

    flask --app examples.flask_shop.app create-tables
    flask --app examples.flask_shop.app run          # and `router serve` beside it

Plain SQLAlchemy 2.0 (no Flask-SQLAlchemy): one engine over psycopg 3 with SQLAlchemy's
default pool, one ``sessionmaker``, and ``SyncOutbox`` on the same database.

- ``POST /orders`` stages ``OrderPlaced`` explicitly: ``outbox.stage(session, ...)``.
- ``POST /orders/<id>/pay`` stages nothing itself: the ``Order`` entity raises ``OrderPaid``
  and ``outbox.stage_on_flush(sessions)`` stages it when the session flushes at commit.

Either way the event is committed with the order row, or rolled back with it.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from flask import Blueprint, Flask, abort, current_app, request
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from router import RaisesEvents, SyncOutbox

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
    """What the views share: the engine, its sessions, the outbox."""

    engine: sa.Engine
    sessions: sessionmaker[Session]
    outbox: SyncOutbox


def shop() -> Shop:
    """The current app's ``Shop``."""
    found: Shop = current_app.extensions["shop"]
    return found


orders = Blueprint("orders", __name__)


@orders.post("/orders")
def place_order() -> tuple[dict[str, Any], int]:
    """Write an order and stage ``OrderPlaced`` in the same transaction."""
    body = request.get_json()
    order_id = str(uuid.uuid4())
    total = Decimal(str(body["total"]))
    with shop().sessions() as session, session.begin():
        session.add(Order(id=order_id, customer=body["customer"], total=total))
        shop().outbox.stage(
            session,
            OrderPlaced(order_id=order_id, customer=body["customer"], total=total),
            stream_key=order_id,
        )
        if body.get("fail_after_stage"):  # shows a failure after stage(): nothing is sent
            raise CheckoutFailed(f"order {order_id} failed after staging")
    return {"id": order_id, "status": "placed"}, 201


@orders.post("/orders/<order_id>/pay")
def pay_order(order_id: str) -> dict[str, Any]:
    """Pay an order; the entity's ``OrderPaid`` is staged when the session commits."""
    with shop().sessions() as session, session.begin():
        order = session.get(Order, order_id, with_for_update=True)
        if order is None:
            abort(404, f"no order {order_id}")
        if order.status == "paid":
            abort(409, f"order {order_id} is paid already")
        order.pay()
    return {"id": order_id, "status": "paid"}


def checkout_failed(error: CheckoutFailed) -> tuple[dict[str, Any], int]:
    """A failed checkout, as JSON."""
    return {"error": str(error)}, 500


def sync_url(url: str) -> sa.URL:
    """``postgresql://...`` (the router's form) as a SQLAlchemy URL on psycopg 3."""
    return sa.make_url(url).set(drivername="postgresql+psycopg")


def create_app() -> Flask:
    """The app: ``$DATABASE_URL`` for its engine, ``$ROUTER_CONFIG`` (else the
    ``config.yaml`` beside this file) for the outbox."""
    app = Flask(__name__)
    engine = sa.create_engine(sync_url(os.environ["DATABASE_URL"]))
    sessions = sessionmaker(engine)
    outbox = SyncOutbox.from_file(os.environ.get("ROUTER_CONFIG", CONFIG))
    outbox.stage_on_flush(sessions)  # Order.raise_event(...) -> staged at flush
    app.extensions["shop"] = Shop(engine, sessions, outbox)
    app.register_blueprint(orders)
    app.register_error_handler(CheckoutFailed, checkout_failed)

    @app.cli.command("create-tables")
    def create_tables() -> None:
        """Create the shop's tables (``router init-db`` creates the outbox's)."""
        Base.metadata.create_all(engine)
        print("created the shop's tables")

    return app
