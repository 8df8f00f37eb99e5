"""Events raised by Django models, staged in the transaction that saves them.

    class Order(RaisesEventsOnSave, models.Model):
        ...

    order = Order(customer="ada", total=Decimal("19.90"))
    order.raise_event(OrderPlaced(order_id=str(order.pk), ...))
    order.save()          # the row and one outbox row per target, in one transaction

``save()`` (and ``delete()``) run in ``transaction.atomic(using=...)``: a savepoint inside the
caller's block, or a transaction of their own outside one, so the model's row and its events
always commit together. The events go in the order raised, on the model's primary key as
stream key unless raised with one, and leave the model once staged: a second ``save()``
stages nothing twice. A rolled-back block takes the rows with it.
"""

from __future__ import annotations

from typing import Any

from router.contrib.django.staging import stage
from router.write.entities import RaisesEvents, take_raised

__all__ = ["RaisesEventsOnSave"]


class RaisesEventsOnSave(RaisesEvents):
    """A Django model mixin: ``raise_event()`` now, staged when the model is saved."""

    pk: Any
    _state: Any

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Save the model and stage the events it raised, in one transaction."""
        from django.db import transaction

        using = self._alias(kwargs.get("using"))
        with transaction.atomic(using=using):
            super().save(*args, **kwargs)  # type: ignore[misc]  # models.Model's
            self._stage_raised(using)

    def delete(self, *args: Any, **kwargs: Any) -> Any:
        """Delete the model and stage the events it raised, in one transaction."""
        from django.db import transaction

        using = self._alias(kwargs.get("using"))
        with transaction.atomic(using=using):
            key = str(self.pk)  # delete() clears the primary key
            deleted = super().delete(*args, **kwargs)  # type: ignore[misc]  # models.Model's
            self._stage_raised(using, key)
        return deleted

    def _alias(self, using: str | None) -> str:
        """The database alias Django will write this model to."""
        from django.db import router

        alias: str = using or router.db_for_write(type(self), instance=self)
        return alias

    def _stage_raised(self, using: str, key: str | None = None) -> None:
        raised = take_raised(self)
        if raised:
            own = key if key is not None else str(self.pk)
            events = [event for event, _ in raised]
            keys = [stream_key or own for _, stream_key in raised]
            stage(*events, using=using, stream_keys=keys)
