"""The partner contract as an AsyncAPI 3.0 document: a server per partner broker, a channel
per (partner, destination) with the bindings that say where to consume it, a message per
event version that partner receives, and a ``send`` operation per channel."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from router.ops.contract._members import named_object
from router.ops.contract._schema import Schema, glob_pattern, hoist_definitions
from router.ops.contract._wire import PartnerMessage

__all__ = ["ASYNCAPI_VERSION", "asyncapi_document"]

ASYNCAPI_VERSION = "3.0.0"

# Keys of AsyncAPI's components, channels, operations and messages.
_NOT_IN_ID = re.compile(r"[^\w.\-]")


def asyncapi_document(
    service: str, version: str, messages: Sequence[PartnerMessage]
) -> dict[str, Any]:
    """The document; ``messages`` sorted by partner, event type and version."""
    schemas: dict[str, Schema] = {}
    components: dict[str, Any] = {}
    servers: dict[str, Any] = {}
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    for message in messages:
        server_id = _id(message.partner)
        if server_id not in servers:
            servers[server_id] = _server(message)
        channel_id = _id(f"{message.partner}.{message.destination}")
        channel = channels.setdefault(
            channel_id,
            {
                "address": message.destination,
                "title": f"{message.destination} on {message.partner}",
                "servers": [{"$ref": f"#/servers/{server_id}"}],
                "messages": {},
                **message.settings.channel_bindings(message.destination),
            },
        )
        key = _id(f"{message.event_type}.v{message.version}")
        message_id = _id(f"{message.partner}.{key}")
        components[message_id] = _message(message, schemas)
        channel["messages"][key] = {"$ref": f"#/components/messages/{message_id}"}
        operation = operations.setdefault(
            _id(f"send.{channel_id}"),
            {
                "action": "send",
                "channel": {"$ref": f"#/channels/{channel_id}"},
                "summary": f"{service} publishes to {message.destination} on {message.partner}.",
                "messages": [],
                **_bindings(message.settings.operation_bindings()),
            },
        )
        operation["messages"].append({"$ref": f"#/channels/{channel_id}/messages/{key}"})
    return {
        "asyncapi": ASYNCAPI_VERSION,
        "info": {
            "title": service,
            "version": version,
            "description": f"The events {service} publishes to its partners, as each partner "
            "receives them (written by `router contract export`). Internal brokers are not "
            "part of it.",
        },
        "servers": servers,
        "channels": channels,
        "operations": operations,
        "components": {"messages": components, **({"schemas": schemas} if schemas else {})},
    }


def _id(text: str) -> str:
    return _NOT_IN_ID.sub("_", text)


def _server(message: PartnerMessage) -> dict[str, Any]:
    settings = message.settings
    protocol = settings.asyncapi_protocol or settings.type
    protocol_version = settings.asyncapi_protocol_version
    hosts, paths = [], []
    # public_url() is the address with credentials and query removed; the host is from it.
    for url in filter(None, settings.public_url().split(",")):
        parts = urlsplit(url if "://" in url else f"//{url}")
        hosts.append(parts.netloc.rpartition("@")[2])
        paths.append(parts.path)
    server: dict[str, Any] = {"host": ",".join(hosts) or "-", "protocol": protocol}
    if protocol_version:
        server["protocolVersion"] = protocol_version
    if paths and paths[0] not in ("", "/"):
        server["pathname"] = paths[0]
    server["title"] = f"{message.partner} ({settings.title or settings.type})"
    server["description"] = f"Partner broker {message.partner!r}, {message.profile} envelope."
    if settings.atomic:
        server["description"] += (
            " Atomic: the events one transaction commits for this partner arrive as one unit, "
            "all or none, together and in order"
            + (f" ({settings.atomic_unit})" if settings.atomic_unit else "")
            + "; never across partners."
        )
    return server


def _message(message: PartnerMessage, schemas: dict[str, Schema]) -> dict[str, Any]:
    owner = _id(f"{message.event_type}.v{message.version}")
    payload = hoist_definitions(message.payload, schemas, owner)
    document: dict[str, Any] = {
        "name": message.event_type,
        "title": f"{message.event_type} v{message.version}",
    }
    summary = (message.event_class.__doc__ or "").strip().split("\n")[0]
    if summary:
        document["summary"] = summary
    document["contentType"] = message.content_type
    document["headers"] = _headers(message)
    document["payload"] = _body(message, payload)
    if any(h.name == "correlation-id" for h in message.headers):
        document["correlationId"] = {"location": "$message.header#/correlation-id"}
    document.update(_bindings(message.settings.message_bindings(message.event_type)))
    if message.properties:
        document["x-properties"] = {
            "type": "object",
            "description": "The broker's own message properties besides the headers, each "
            "derived from the stored event (the same on every publish of it).",
            "properties": {p.name: p.schema for p in message.properties},
            "required": [p.name for p in message.properties if p.required],
        }
    return document


def _bindings(bindings: dict[str, Any]) -> dict[str, Any]:
    return {"bindings": bindings} if bindings else {}


def _body(message: PartnerMessage, payload: Schema) -> Schema:
    if message.payload_member is None:
        return payload
    body: Schema = {
        "type": "object",
        "properties": {
            **{m.name: m.schema for m in message.envelope},
            message.payload_member: payload,
        },
        "required": [m.name for m in message.envelope if m.required] + [message.payload_member],
    }
    if message.extensions and message.profile == "cloudevents":
        body["patternProperties"] = named_object(message.extensions, "")["patternProperties"]
        body["description"] = (
            "A CloudEvent; its extension attributes are the extensions staged with the event "
            f"whose names match {', '.join(message.extensions)} (any case)."
        )
    return body


def _headers(message: PartnerMessage) -> Schema:
    schema: Schema = {
        "type": "object",
        "properties": {h.name: h.schema for h in message.headers},
        "required": [h.name for h in message.headers if h.required],
    }
    patterns: dict[str, Schema] = {}
    for glob in message.staged_headers:
        patterns[glob_pattern(glob)] = {
            "type": "string",
            "description": f"A header staged with the event whose name matches {glob!r} "
            "(expose.headers, any case); the router's own headers win over a staged one.",
        }
    prefix = message.settings.binary_prefix or ""
    for glob in message.extensions if prefix else ():
        patterns[glob_pattern(prefix + glob)] = {
            "type": "string",
            "description": f"A CloudEvents extension attribute whose name matches {glob!r} "
            "(expose.extensions, any case).",
        }
    if patterns:
        schema["patternProperties"] = patterns
    return schema
