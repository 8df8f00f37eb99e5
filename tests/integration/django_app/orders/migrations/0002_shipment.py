"""The ``orders_shipment`` table: a model that raises events."""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):  # type: ignore[misc]  # Django ships no type hints
    dependencies = [("orders", "0001_initial")]
    operations = [
        migrations.CreateModel(
            name="Shipment",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("order_ref", models.CharField(max_length=100)),
                ("quantity", models.IntegerField(default=1)),
            ],
        ),
    ]
