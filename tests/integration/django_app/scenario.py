"""Steps a test runs on the test project, in this process; each prints one JSON line.

    python -m tests.integration.django_app.scenario migrate commit

with ``DJANGO_SETTINGS_MODULE=tests.integration.django_app.settings`` and the variables
``settings`` reads.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import django

from router import StagingError
from router.contrib.django import init_db, schema_revision, stage
from tests.integration.events import OrderPlaced, StockReserved


def _place(using: str = "default") -> tuple[int, list[str]]:
    """Save an order and stage its event on ``using``'s open transaction."""
    from tests.integration.django_app.orders.models import Order

    order = Order.objects.using(using).create(customer="ada", total=Decimal("9.50"))
    ids = stage(
        OrderPlaced(order_id=str(order.pk), total=order.total),
        using=using,
        stream_key=str(order.pk),
        correlation_id="req-1",
    )
    return int(order.pk), ids


def migrate() -> dict[str, Any]:
    """Django's own tables (and the app's), with ``manage.py migrate``."""
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return {}


def migrate_bare() -> dict[str, Any]:
    """Django's own tables (and the app's) on a database without the router's, whose check
    would stop ``migrate``."""
    from django.core.management import call_command

    call_command("migrate", verbosity=0, skip_checks=True)
    return {}


def refused() -> dict[str, Any]:
    """An order, a ``stage()`` refused (no router tables), another order: one block."""
    from django.db import transaction

    from tests.integration.django_app.orders.models import Order

    error = None
    with transaction.atomic():
        before = Order.objects.create(customer="ada", total=Decimal(1))
        try:
            stage(OrderPlaced(order_id=str(before.pk), total=before.total))
        except StagingError as exc:
            error = str(exc)
        after = Order.objects.create(customer="bob", total=Decimal(2))
    return {"error": error, "orders": [int(before.pk), int(after.pk)]}


def commit() -> dict[str, Any]:
    """An order and its event in one ``atomic()`` block that commits."""
    from django.db import transaction

    with transaction.atomic():
        order, ids = _place()
    return {"order": order, "ids": ids}


def units() -> dict[str, Any]:
    """Orders in three transactions: two calls of a view decorated with
    ``transaction.atomic`` (one ``Atomic`` object, entered afresh by each call), then one
    block with an order before and after a savepoint that rolls back its own order."""
    from django.db import transaction

    block = transaction.atomic()  # as @transaction.atomic makes one for a view

    def view() -> list[str]:
        with block:
            return _place()[1]

    first, second = view(), view()
    with transaction.atomic():
        both = _place()[1]
        try:
            with transaction.atomic():  # a savepoint
                _place()
                raise RuntimeError("inner")
        except RuntimeError:
            pass
        both += _place()[1]
    return {"first": first, "second": second, "both": both}


def rollback() -> dict[str, Any]:
    """An order and its event in a block that raises."""
    from django.db import transaction

    try:
        with transaction.atomic():
            order, ids = _place()
            raise RuntimeError("business rule")
    except RuntimeError as exc:
        return {"order": order, "ids": ids, "raised": str(exc)}


def outside() -> dict[str, Any]:
    """``stage()`` with no ``atomic()`` block open."""
    try:
        stage(OrderPlaced(order_id="o-1", total=Decimal(1)))
    except StagingError as exc:
        return {"error": str(exc)}
    return {"error": None}


def other() -> dict[str, Any]:
    """An order and its event on the alias ``other``, in ``atomic(using="other")``."""
    from django.db import connections, transaction

    with transaction.atomic(using="other"):
        order, ids = _place("other")
        default_in_block = connections["default"].in_atomic_block
    return {"order": order, "ids": ids, "default_in_block": default_in_block}


def entity() -> dict[str, Any]:
    """A model raises two events and is saved outside any block, then saved again."""
    from tests.integration.django_app.orders.models import Shipment

    shipment = Shipment(order_ref="o-7", quantity=2)
    shipment.raise_event(StockReserved(order_id="o-7", quantity=2))
    shipment.raise_event(OrderPlaced(order_id="o-7", total=Decimal(3)), stream_key="o-7")
    shipment.save()  # its own transaction: the row and the events together
    shipment.quantity = 3
    shipment.save()  # nothing raised since: nothing staged
    return {"shipment": int(shipment.pk), "waiting": len(shipment.raised_events)}


def entity_rollback() -> dict[str, Any]:
    """A model saved with an event inside a block that then raises."""
    from django.db import transaction

    from tests.integration.django_app.orders.models import Shipment

    try:
        with transaction.atomic():
            shipment = Shipment(order_ref="o-8")
            shipment.raise_event(StockReserved(order_id="o-8", quantity=1))
            shipment.save()
            raise RuntimeError("business rule")
    except RuntimeError as exc:
        return {"raised": str(exc)}
    return {"raised": None}


def entity_retry() -> dict[str, Any]:
    """A model saved with an event in a block that rolls back, then saved again (a retry);
    then one saved in a savepoint that rolls back, and again in the block around it."""
    from django.db import transaction

    from tests.integration.django_app.orders.models import Shipment

    first = Shipment(order_ref="o-9")
    first.raise_event(StockReserved(order_id="o-9", quantity=1))
    try:
        with transaction.atomic():
            first.save()
            raise RuntimeError("serialization failure")
    except RuntimeError:
        pass
    waiting = len(first.raised_events)
    first.save()  # the retry, in a transaction of its own
    second = Shipment(order_ref="o-10")
    with transaction.atomic():
        second.raise_event(StockReserved(order_id="o-10", quantity=2))
        try:
            with transaction.atomic():  # a savepoint
                second.save()
                raise RuntimeError("inner")
        except RuntimeError:
            pass
        second.save()
        second.save()  # staged already in this block: nothing twice
    return {"waiting": waiting, "shipments": [int(first.pk), int(second.pk)]}


def entity_bulk() -> dict[str, Any]:
    """``bulk_create()`` and ``bulk_update()`` of models with events waiting."""
    from django.db import transaction

    from tests.integration.django_app.orders.models import Shipment

    errors = []
    new = Shipment(order_ref="o-11")
    new.raise_event(StockReserved(order_id="o-11", quantity=1))
    saved = Shipment.objects.create(order_ref="o-12")  # nothing raised: nothing staged
    saved.raise_event(StockReserved(order_id="o-12", quantity=2))
    saved.quantity = 2
    bulks: list[Callable[[], object]] = [
        lambda: Shipment.objects.bulk_create([new]),
        lambda: Shipment.objects.bulk_update([saved], ["quantity"]),
    ]
    for bulk in bulks:
        try:
            with transaction.atomic():
                bulk()
        except StagingError as exc:
            errors.append(str(exc))
    waiting = [len(new.raised_events), len(saved.raised_events)]
    return {"errors": errors, "waiting": waiting, "saved": int(saved.pk)}


def entity_update() -> dict[str, Any]:
    """A model raises, its row is written by ``QuerySet.update()``, and it is dropped."""
    import gc
    import logging

    from tests.integration.django_app.orders.models import Shipment

    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("router").addHandler(handler)
    shipment = Shipment.objects.create(order_ref="o-12")
    shipment.raise_event(StockReserved(order_id="o-12", quantity=5))
    Shipment.objects.filter(pk=shipment.pk).update(quantity=5)
    del shipment
    gc.collect()
    return {"logged": logged}


BATCH_ORDER_ID = 'n {n}: tab\there, new\nline, back\\slash, "quoted", \\N'
"""A batch event's order id, with what a text COPY must escape."""


def batch() -> dict[str, Any]:
    """100 events over many streams (and none) in one ``stage()``: the bulk form."""
    from django.db import transaction

    events = [StockReserved(order_id=BATCH_ORDER_ID.format(n=n), quantity=n) for n in range(100)]
    keys = [f"s-{n % 40}" if n % 7 else None for n in range(100)]
    with transaction.atomic():
        ids = stage(*events, stream_keys=keys)
    return {"ids": ids, "keys": keys, "order_ids": [e.order_id for e in events]}


def init() -> dict[str, Any]:
    """``init_db("default")``, and the revision read with Django's connection after it."""
    from django.db import connections

    result = init_db("default")
    return {
        "before": result.before,
        "after": result.after,
        "revision": schema_revision(connections["default"]),
    }


STEPS: dict[str, Callable[[], dict[str, Any]]] = {
    "migrate": migrate,
    "migrate_bare": migrate_bare,
    "refused": refused,
    "commit": commit,
    "rollback": rollback,
    "units": units,
    "outside": outside,
    "other": other,
    "init_db": init,
    "entity": entity,
    "entity_rollback": entity_rollback,
    "entity_retry": entity_retry,
    "entity_bulk": entity_bulk,
    "entity_update": entity_update,
    "batch": batch,
}


def main(steps: list[str]) -> None:
    """Run ``steps`` in order."""
    django.setup()
    for step in steps:
        print(json.dumps({"step": step, **STEPS[step]()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
