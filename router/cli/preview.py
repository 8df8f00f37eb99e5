"""``router preview``: the exact message each target would receive for an event."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from envelopes import ConfigError, StagingError
from router._secrets import Redactor
from router.cli.arguments import pairs, positive, whole
from router.cli.output import EXIT_CONFIG, EXIT_OK, emit, table
from router.config import RouterConfig
from router.write.catalog import load_catalog

if TYPE_CHECKING:
    from router.ops.preview import Preview

__all__ = ["add_parser", "pin_notes", "preview", "preview_block", "side_by_side_table"]


def add_parser(commands: Any) -> None:
    """Register ``router preview``."""
    preview_ = commands.add_parser(
        "preview", help="the exact message each target would get for an event"
    )
    preview_.add_argument("event_type", metavar="EVENT_TYPE")
    preview_.add_argument(
        "--target", action="append", help="this target only (repeatable; default: all of them)"
    )
    preview_.add_argument(
        "--all-targets", action="store_true", help="every target of the event, side by side"
    )
    given = preview_.add_mutually_exclusive_group()
    given.add_argument("--payload", metavar="JSON", help="the event's fields as JSON")
    given.add_argument(
        "--example", action="store_true", help="an example made from the event class (default)"
    )
    preview_.add_argument(
        "--version",
        type=positive,
        help="stage this version of the event type (default: the newest); a target pinned to "
        "an older one is shown it downcast, with a note",
    )
    preview_.add_argument("--database", help="as staged in this database")
    preview_.add_argument("--stream-key", help="the stream key to stage with")
    preview_.add_argument(
        "--header", action="append", default=[], metavar="NAME=VALUE", help="a staged header"
    )
    preview_.add_argument(
        "--extension", action="append", default=[], metavar="NAME=VALUE", help="an extension"
    )
    preview_.add_argument("--correlation-id", metavar="ID", help="the correlation id to stage with")
    preview_.add_argument("--causation-id", metavar="ID", help="the causation id to stage with")
    preview_.add_argument("--tenant", help="the tenant to stage with")
    preview_.add_argument(
        "--priority",
        type=whole,
        metavar="N",
        help="the priority to stage with (shown where the message carries it)",
    )
    preview_.add_argument(
        "--skipped",
        action="append",
        default=[],
        metavar="MESSAGE_ID",
        help="as sent after a gap in its stream: the message id of a row of the stream key "
        "abandoned before it (oldest first; needs --stream-key)",
    )
    preview_.add_argument("--json", action="store_true")
    preview_.set_defaults(run=preview)


async def preview(config: RouterConfig, args: argparse.Namespace, redactor: Redactor) -> int:
    from router.ops.preview import preview

    try:
        previews = preview(
            config,
            load_catalog(config.events, config.base_dir),
            args.event_type,
            targets=None if args.all_targets else args.target,
            database=args.database,
            version=args.version,
            payload=args.payload,
            stream_key=args.stream_key,
            headers=pairs(args.header, "--header"),
            extensions=pairs(args.extension, "--extension"),
            correlation_id=args.correlation_id,
            causation_id=args.causation_id,
            tenant=args.tenant,
            priority=args.priority,
            skipped=args.skipped,
        )
    except (ConfigError, StagingError) as exc:
        print(f"router: {redactor(str(exc))}", file=sys.stderr)
        return EXIT_CONFIG
    if args.version is not None:
        for note in pin_notes(previews, args.event_type):
            print(f"router: note: {note}", file=sys.stderr)
    side_by_side = args.all_targets or len(previews) > 1
    human = side_by_side_table(previews) if side_by_side else preview_block(previews[0])
    emit(args, [p.as_dict() for p in previews], human, redactor)
    return EXIT_OK


def pin_notes(items: Sequence[Preview], event_type: str) -> list[str]:
    """A line for each target pinned to another version than the one asked for (``--version``):
    what it is shown is what it receives, the event downcast to its pin."""
    return [
        f"target {item.target!r} is pinned to {event_type!r} version {item.pinned_version}: "
        f"it receives version {item.staged_version} downcast to version {item.pinned_version}, "
        "as shown"
        for item in items
        if item.pinned_version is not None and item.pinned_version != item.staged_version
    ]


def _pin(item: Preview) -> str | None:
    """The pinned version and where it comes from, for a pinned target."""
    if item.pinned_version is None:
        return None
    if item.pinned_version == item.staged_version:
        return f"{item.pinned_version}, pinned"
    return f"{item.pinned_version}, pinned (downcast from {item.staged_version})"


def preview_block(item: Preview) -> str:
    """One target's message, as it would be sent."""
    width = max((len(name) for name in (*item.headers, *item.properties)), default=0)
    pin = _pin(item)
    properties = [f"  {name.ljust(width)}  {value}" for name, value in item.properties.items()]
    lines = [
        f"target       {item.target} ({item.kind}, {item.profile} profile)",
        *([f"version      {pin}"] if pin else []),
        f"destination  {item.destination}",
        *(f"{key:<12} {_where(value)}" for key, value in item.sent.binding.items()),
        "headers",
        *(f"  {name.ljust(width)}  {value}" for name, value in item.headers.items()),
        *(["properties", *properties] if properties else []),
        f"body ({item.wire.content_type}, {len(item.wire.body):,} bytes)",
        json.dumps(item.body_document(), indent=2, ensure_ascii=False),
    ]
    return "\n".join(lines)


def side_by_side_table(items: Sequence[Preview], *, width: int = 36) -> str:
    """Every target in a column; a row per destination, header and body member, with '-'
    where a target does not get it."""
    rows: dict[str, list[str | None]] = {}

    def put(key: str, column: int, value: Any) -> None:
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        cut = text if len(text) <= width else text[: width - 1] + "…"
        rows.setdefault(key, [None] * len(items))[column] = cut

    for column, item in enumerate(items):
        put("destination", column, item.destination)
        for key, value in item.sent.binding.items():
            put(key, column, _where(value))
        put("profile", column, item.profile)
        if (pin := _pin(item)) is not None:
            put("version", column, pin)
        for name, value in item.headers.items():
            put(f"header {name}", column, value)
        for name, native in item.properties.items():
            put(f"property {name}", column, str(native))
        for path, value in _flatten(item.body_document()):
            put(f"body {path}", column, value)
    header = ["", *(f"{item.target} ({item.kind})" for item in items)]
    return table(header, [[key, *values] for key, values in rows.items()])


def _where(value: Any) -> str:
    """A binding's value in words: ``shop.events (topic, durable)``, ``PARTNERS``, ``0``."""
    if not isinstance(value, dict):
        return str(value).lower() if isinstance(value, bool) else str(value)
    traits = [
        (key if item else f"not {key}") if isinstance(item, bool) else str(item)
        for key, item in value.items()
        if key != "name"
    ]
    return f"{value.get('name', '')} ({', '.join(traits)})" if traits else str(value.get("name"))


def _flatten(document: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted path, value)`` for every leaf of a JSON document (an empty map is a leaf)."""
    if isinstance(document, dict) and document:
        return [
            pair
            for key, value in document.items()
            for pair in _flatten(value, f"{prefix}.{key}" if prefix else key)
        ]
    return [(prefix or ".", document)]
