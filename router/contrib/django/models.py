"""Events raised by Django models, staged in the transaction that saves them.

    class Order(RaisesEventsOnSave, models.Model):
        ...

    order = Order(customer="ada", total=Decimal("19.90"))
    order.raise_event(OrderPlaced(order_id=str(order.pk), ...))
    order.save()          # the row and one outbox row per target, in one transaction

``save()`` (and ``delete()``) run in ``transaction.atomic(using=...)``: a savepoint inside the
caller's block, or a transaction of their own outside one, so the model's row and its events
always commit together. The events go in the order raised, on the model's primary key as
stream key unless raised with one.

A staged event leaves the model until its transaction ends: a second ``save()`` in the same
transaction stages nothing twice; a rollback (of the block, or of the savepoint it was staged
in) puts it back on the model, so saving the model again (a retry) stages it again.
``bulk_create()`` and ``bulk_update()`` save no model one by one, so a model with events
waiting is refused there with ``StagingError``; a model dropped with events waiting (its row
written by ``QuerySet.update()``, say) is logged as ``router.entity.events_unstaged``.
"""

from __future__ import annotations

from typing import Any

from envelopes import StagingError
from router.contrib.django.staging import stage
from router.write.entities import Raised, RaisesEvents, put_back, take, waiting
from router.write.events import Event

__all__ = ["RaisesEventsOnSave"]

_STAGED = "_router_staged_batches"  # on a model: batches staged in transactions still open
_BULK = frozenset({"bulk_create", "bulk_update"})


class _Batch:
    """Events a model staged in one transaction, until its commit hook says it committed."""

    def __init__(self, model: Any, raised: list[Raised], using: str) -> None:
        self.model = model
        self.raised = raised
        self.using = using

    def __call__(self) -> None:
        """Django's on_commit hook: staged for good."""
        self.model.__dict__.get(_STAGED, []).remove(self)


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

    def _prepare_related_fields_for_save(self, operation_name: str, fields: Any = None) -> None:
        # Django calls this on every model bulk_create() and bulk_update() write, before they
        # write anything: the one place those two let a model refuse.
        if operation_name in _BULK and waiting(self):
            raise StagingError(
                f"{type(self).__name__} {self.pk!r} has {len(waiting(self))} raised event(s) "
                f"waiting, and {operation_name}() saves no model one by one, so they cannot "
                "be staged with it: save() each model, or stage the events with "
                "router.contrib.django.stage() in the same transaction.atomic() block"
            )
        super()._prepare_related_fields_for_save(operation_name, fields)  # type: ignore[misc]

    def _alias(self, using: str | None) -> str:
        """The database alias Django will write this model to."""
        from django.db import router

        alias: str = using or router.db_for_write(type(self), instance=self)
        return alias

    def _stage_raised(self, using: str, key: str | None = None) -> None:
        from django.db import transaction

        self._unstage_rolled_back()
        raised = take(self)
        if not raised:
            return
        own = key if key is not None else str(self.pk)
        try:
            stage(
                *[r.event for r in raised],
                using=using,
                stream_keys=[r.stream_key or own for r in raised],
            )
        except BaseException:
            put_back(self, raised)
            raise
        batch = _Batch(self, raised, using)
        self.__dict__.setdefault(_STAGED, []).append(batch)
        transaction.on_commit(batch, using=using)

    @property
    def raised_events(self) -> list[Event]:
        """The events raised and not staged yet (or staged in a block since rolled back)."""
        self._unstage_rolled_back()
        return super().raised_events

    def _unstage_rolled_back(self) -> None:
        """Put back the events of batches whose transaction rolled back: Django drops the
        on_commit hooks of a rolled-back block or savepoint (``run_on_commit``, its list of
        ``(savepoint ids, hook, robust)``), and runs a committed one's, which forgets it."""
        from django.db import connections

        batches: list[_Batch] = self.__dict__.get(_STAGED, [])
        for batch in list(batches):
            pending = connections[batch.using].run_on_commit
            if not any(hook is batch for _, hook, _ in pending):
                batches.remove(batch)
                put_back(self, batch.raised)
