"""One business table, written in the same transaction as the events."""

from __future__ import annotations

from django.db import models

from router.contrib.django import RaisesEventsOnSave


class Order(models.Model):  # type: ignore[misc]  # Django ships no type hints
    """An order a customer placed."""

    customer = models.CharField(max_length=100)
    total = models.DecimalField(max_digits=10, decimal_places=2)


class Shipment(RaisesEventsOnSave, models.Model):  # type: ignore[misc]
    """A model whose events are staged when it is saved."""

    order_ref = models.CharField(max_length=100)
    quantity = models.IntegerField(default=1)
