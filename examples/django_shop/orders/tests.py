"""The shop's own tests, as ``python manage.py test`` runs them: Django's test database gets
the router's tables after its ``migrate`` (the ``router.contrib.django`` app sees to it), so
an order's event can be staged and read back there, with no ``router init-db``."""

from __future__ import annotations

from decimal import Decimal
from io import StringIO

from django.core.management import call_command
from django.db import connection
from django.test import TestCase

from orders.models import Order


class PlaceOrderTests(TestCase):  # type: ignore[misc]  # Django ships no type hints
    """``place_order`` writes the order and its outbox row in one transaction."""

    def test_an_order_and_its_event_are_staged_together(self) -> None:
        """One order, and one outbox row for the internal broker, keyed by the order."""
        call_command("place_order", "--customer", "ada", "--total", "19.90", stdout=StringIO())
        order = Order.objects.get()
        assert order.total == Decimal("19.90")
        with connection.cursor() as cursor:
            cursor.execute("SELECT target, event_type, stream_key, status FROM router_outbox")
            rows = list(cursor.fetchall())
        assert rows == [("events", "order_placed", str(order.pk), "pending")]
