"""The ``orders_order`` table (made with ``manage.py makemigrations orders``)."""

from __future__ import annotations

import uuid

from django.db import migrations, models


class Migration(migrations.Migration):  # type: ignore[misc]  # Django ships no type hints
    initial = True
    dependencies: list[tuple[str, str]] = []
    operations = [
        migrations.CreateModel(
            name="Order",
            fields=[
                (
                    "id",
                    models.UUIDField(
                        default=uuid.uuid4, editable=False, primary_key=True, serialize=False
                    ),
                ),
                ("customer", models.CharField(max_length=200)),
                ("total", models.DecimalField(decimal_places=2, max_digits=10)),
                ("placed_at", models.DateTimeField(auto_now_add=True)),
            ],
        ),
    ]
