"""outbox-router for Django: stage events in the transaction of a Django database.

    # settings.py
    INSTALLED_APPS = [..., "router.contrib.django"]
    ROUTER_CONFIG = "config.yaml"         # relative to BASE_DIR; default: $ROUTER_CONFIG

    # a view, a management command, a Celery task
    from django.db import transaction
    from router.contrib.django import stage

    with transaction.atomic():
        order = Order.objects.create(...)
        stage(OrderPlaced(order_id=str(order.pk)), stream_key=str(order.pk))

``stage()`` runs on ``django.db.connections[using]`` (``using="default"``) and refuses to run
outside ``transaction.atomic(using=...)``: the rows are the block's, committed or rolled back
with it. One ``SyncOutbox`` per process is built from the config on first use
(``get_outbox()``).

The router's tables come from ``router init-db`` (or ``init_db(using)``), never from a
Django migration: ``router.contrib.django.schema`` says why. Django databases ``config.yaml``
does not name, Django's test databases above all, get them after ``migrate``
(``router.contrib.django.tables``), so ``manage.py test`` needs no setup. The app registers
a system check (tag ``database``): ``manage.py check --database default`` fails with
``router.E001`` until they are at the newest revision.

Django is imported only inside this package.
"""

from router.contrib.django.config import config_path, get_outbox, reset_outbox
from router.contrib.django.databases import matching_database, router_database
from router.contrib.django.models import RaisesEventsOnSave
from router.contrib.django.schema import check_schema, schema_revision
from router.contrib.django.staging import stage
from router.contrib.django.tables import init_db

__all__ = [
    "RaisesEventsOnSave",
    "check_schema",
    "config_path",
    "get_outbox",
    "init_db",
    "matching_database",
    "reset_outbox",
    "router_database",
    "schema_revision",
    "stage",
]
