"""``python manage.py place_order``: save an order and stage ``OrderPlaced`` in one
transaction, so the event exists exactly when the order does."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django.core.management.base import BaseCommand
from django.db import transaction

from orders.events import OrderPlaced
from orders.models import Order
from router.contrib.django import stage


class Command(BaseCommand):  # type: ignore[misc]  # Django ships no type hints
    """Place one order."""

    help = "Save an order and stage OrderPlaced in one transaction."

    def add_arguments(self, parser: Any) -> None:
        """``--customer`` and ``--total``."""
        parser.add_argument("--customer", default="ada@example.com")
        parser.add_argument("--total", type=Decimal, default=Decimal("42.50"))

    def handle(self, *args: Any, customer: str, total: Decimal, **options: Any) -> None:
        """Write the order and its event; both commit together, or neither does."""
        with transaction.atomic():
            order = Order.objects.create(customer=customer, total=total)
            [message_id] = stage(
                OrderPlaced(order_id=str(order.pk), customer=customer, total=total),
                stream_key=str(order.pk),
            )
        self.stdout.write(f"placed order {order.pk}: staged order_placed {message_id}")
