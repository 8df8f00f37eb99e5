"""The shop's business table."""

from __future__ import annotations

import uuid

from django.db import models


class Order(models.Model):  # type: ignore[misc]  # Django ships no type hints
    """An order a customer placed."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    customer = models.CharField(max_length=200)
    total = models.DecimalField(max_digits=10, decimal_places=2)
    placed_at = models.DateTimeField(auto_now_add=True)
