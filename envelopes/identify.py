"""Which event a received message is: its message id, whatever the profile and broker.

Every message the router sends carries the id in a ``message-id`` header; the broker's own
id (``Nats-Msg-Id``, AMQP and Service Bus ``message_id``) and CloudEvents ``id`` (binary
mode headers, or the structured body) carry it too, as does the ``id`` of the internal and
external JSON envelopes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

__all__ = ["message_id_of"]

_HEADERS = ("message-id", "Nats-Msg-Id", "ce_id", "ce-id", "cloudEvents:id", "cloudEvents_id")


def message_id_of(
    body: bytes | str | None,
    headers: Mapping[str, Any] | None = None,
    *,
    native_id: str | None = None,
) -> str | None:
    """The event's message id, from the headers, the body, or the broker's own id."""
    for name in _HEADERS:
        value = _text((headers or {}).get(name))
        if value:
            return value
    if body:
        try:
            document = orjson.loads(body)
        except orjson.JSONDecodeError:
            document = None
        if isinstance(document, dict) and isinstance(document.get("id"), str):
            # internal / external envelopes and structured CloudEvents all name it "id"
            return str(document["id"])
    return native_id or None


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)
