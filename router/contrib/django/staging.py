"""``stage()``: events as outbox rows in the transaction of one of Django's databases."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Unpack

from envelopes import StageOptions
from router.contrib.django.config import get_outbox
from router.contrib.django.databases import router_database
from router.write.events import Event
from router.write.sync import SyncOutbox

__all__ = ["stage"]

# The router database of each Django alias, per outbox (a new one comes with a new config):
# matching the two by location parses both URLs, a tenth of a stage() call's own time.
_matched: dict[str, tuple[SyncOutbox, str]] = {}


def stage(
    *events: Event,
    using: str = "default",
    database: str | None = None,
    stream_key: str | None = None,
    stream_keys: Sequence[str | None] | None = None,
    **options: Unpack[StageOptions],
) -> list[str]:
    """Stage ``events`` in the open ``transaction.atomic(using=using)`` block; returns their
    ids. The rows commit or roll back with that block.

    ``using``: the Django database alias. ``database``: the router database (a key of
    ``databases:`` in ``config.yaml``) whose brokers get the events; by default the one at
    the same place as ``using`` (``router.contrib.django.databases``), else the only one
    configured. ``StagingError`` outside ``transaction.atomic()``, and in every case
    ``SyncOutbox.stage`` names; nothing is written then.
    """
    from django.db import connections

    connection = connections[using]
    outbox = get_outbox()
    name = database if database is not None else _router_database(outbox, using, connection)
    return outbox.stage(
        connection,
        *events,
        database=name,
        stream_key=stream_key,
        stream_keys=stream_keys,
        **options,
    )


def _router_database(outbox: SyncOutbox, alias: str, connection: Any) -> str:
    matched = _matched.get(alias)
    if matched is not None and matched[0] is outbox:
        return matched[1]
    name = router_database(outbox.config, connection)
    _matched[alias] = (outbox, name)
    return name
