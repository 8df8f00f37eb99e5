"""The lock: the partner contract as a stable JSON document meant to be committed, so that
``router contract check`` can tell what a change of code or config does to partners."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from envelopes import ConfigError
from router.ops.contract._wire import PartnerMessage

__all__ = [
    "FIRST_FORMAT",
    "LOCK_FILE",
    "LOCK_FORMAT",
    "lock_document",
    "lock_text",
    "os_reason",
    "read_lock",
]

LOCK_FILE = "contracts.lock.json"
LOCK_FORMAT = "outbox-router partner contract lock, 2"
FIRST_FORMAT = "outbox-router partner contract lock, 1"
"""Still read: its payload schemas list every field written as required, defaults included
(format 2 lists only the fields without a default); its bindings lack what later formats add."""


def lock_document(service: str, messages: Sequence[PartnerMessage]) -> dict[str, Any]:
    """Per partner its broker kind, envelope and binding (the exchange, stream... a consumer
    is bound to, and RabbitMQ's persistent and mandatory), then per event type and version: the
    destination, content type, envelope members, header names (with the values fixed per
    event version, such as source) and payload schema."""
    partners: dict[str, Any] = {}
    for message in messages:
        partner = partners.setdefault(
            message.partner,
            {
                "kind": message.settings.type,
                "envelope": message.profile,
                "binding": {**message.settings.location(), **message.settings.delivery()},
                "events": {},
            },
        )
        versions = partner["events"].setdefault(message.event_type, {})
        versions[str(message.version)] = {
            "destination": message.destination,
            "content_type": message.content_type,
            "envelope": {
                "fields": {member.name: member.schema for member in message.envelope},
                "required": sorted(m.name for m in message.envelope if m.required),
                "extensions": sorted(message.extensions),
            },
            "headers": {
                "required": sorted(h.name for h in message.headers if h.required),
                "optional": sorted(h.name for h in message.headers if not h.required),
                "staged": sorted(message.staged_headers),
                "values": {
                    h.name: h.schema["const"] for h in message.headers if "const" in h.schema
                },
            },
            "payload": message.payload,
        }
    return {"contract": LOCK_FORMAT, "service": service, "partners": partners}


def lock_text(document: dict[str, Any]) -> str:
    """Sorted and indented, so that a change shows as a small diff in review."""
    return json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def read_lock(path: Path) -> dict[str, Any] | None:
    """The lock at ``path``; None when there is none. ConfigError when it is not a lock."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {os_reason(path, exc)}") from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not JSON ({exc}); run `router contract lock`") from None
    if not isinstance(document, dict) or document.get("contract") not in (
        LOCK_FORMAT,
        FIRST_FORMAT,
    ):
        raise ConfigError(f"{path}: not a contract lock; run `router contract lock`")
    return document


def os_reason(path: Path, exc: OSError) -> str:
    """Why ``path`` could not be opened, in words (no errno, no traceback)."""
    if isinstance(exc, FileNotFoundError):
        return f"its folder {path.parent} does not exist"
    if isinstance(exc, IsADirectoryError):
        return "it is a directory"
    return (exc.strerror or str(exc)).lower()
