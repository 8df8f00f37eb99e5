"""The operator commands of ``router``: status, requeue, trace, pause/resume, cleanup,
preview and contract, each printing a table (or ``--json``) and returning its exit code.

Each imports what it uses when it runs (SQLAlchemy for the database queries, the contract
tools...): ``router.ops.cli`` imports this module for every command, ``router serve`` too.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from envelopes import ConfigError, StagingError
from router._secrets import Redactor
from router.config import RouterConfig
from router.write.catalog import load_catalog

__all__ = [
    "EXIT_CONFIG",
    "EXIT_FAILED",
    "EXIT_OK",
    "cleanup",
    "contract",
    "pause",
    "preview",
    "requeue",
    "trace",
]

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2


def emit(args: argparse.Namespace, document: Any, human: str, redactor: Redactor) -> None:
    """``human``, or with ``--json`` the document; either way with every secret masked (an
    error text may quote a URL with its password)."""
    print(redactor(json.dumps(document, indent=2, default=str) if args.json else human))


async def requeue(config: RouterConfig, args: argparse.Namespace, redactor: Redactor) -> int:
    from router.ops import operations
    from router.ops.audit import cli_actor

    if args.group:
        from router.ops.commands_groups import requeue_group

        return await requeue_group(config, args, redactor)
    statuses = ("abandoned", "failed") if args.failed else ("abandoned",)
    counts = await operations.requeue(
        config,
        args.database,
        targets_=args.target,
        event_types=args.event_type,
        error=args.error,
        since=args.since,
        until=args.until,
        statuses=statuses,
        dry_run=args.dry_run,
        actor=cli_actor(),
    )
    total = sum(counts.values())
    verb = "would requeue" if args.dry_run else "requeued"
    human = "\n".join(f"{db}: {verb} {n} row(s)" for db, n in counts.items())
    emit(args, {"dry_run": args.dry_run, "rows": counts, "total": total}, human, redactor)
    return EXIT_OK


async def trace(config: RouterConfig, args: argparse.Namespace, redactor: Redactor) -> int:
    from router.ops import operations

    rows = await operations.trace(config, args.message_id)
    if not rows and not args.json:
        print(f"no outbox row has message id {args.message_id}")
        return EXIT_FAILED
    blocks = [f"message {args.message_id} ({rows[0].event_type})"] if rows else []
    for r in rows:
        # A block per target: a message has a few targets, and each has more to say
        # (times, the receipt, an error) than a table row can hold legibly.
        fields: list[tuple[str, object]] = [
            ("destination", r.destination),
            ("attempts", r.attempts),
            ("first attempt", r.first_attempt_at),
            ("last attempt", r.last_attempt_at),
            ("published at", r.published_at),
            ("receipt", _receipt_text(r.receipt)),
            ("lease holder", r.locked_by),
            ("last error", r.last_error),
        ]
        lines = [f"\n{r.database}/{r.target}: {r.status}"]
        lines += [f"  {name:<14} {'-' if value is None else value}" for name, value in fields]
        blocks.append("\n".join(lines))
    emit(
        args,
        {"message_id": args.message_id, "rows": [r.as_dict() for r in rows]},
        redactor("\n".join(blocks)),
        redactor,
    )
    return EXIT_OK if rows else EXIT_FAILED


def _receipt_text(receipt: dict[str, Any] | None) -> str | None:
    """``stream=EVENTS seq=12``: the broker's receipt, one line."""
    if not receipt:
        return None
    return " ".join(f"{key}={value}" for key, value in receipt.items())


async def pause(config: RouterConfig, args: argparse.Namespace, redactor: Redactor) -> int:
    from router.ops import operations
    from router.ops.audit import cli_actor

    paused = args.command == "pause"
    by = cli_actor()
    databases = await operations.set_paused(
        config, args.target, paused=paused, database=args.database, by=by, actor=by
    )
    state = "paused" if paused else "resumed"
    emit(
        args,
        {"target": args.target, "paused": paused, "databases": databases},
        f"{args.target}: {state} in {', '.join(databases)}",
        redactor,
    )
    return EXIT_OK


async def cleanup(config: RouterConfig, args: argparse.Namespace, redactor: Redactor) -> int:
    from router.ops import operations

    done = await operations.cleanup(config, args.database)
    retention = config.outbox.retention
    human = "\n".join(
        f"{d.database}: deleted {d.published} published row(s) older than "
        f"{_span(retention.published)}, {d.abandoned} abandoned row(s) older than "
        f"{_span(retention.abandoned)}, {d.inbox} inbox record(s) older than "
        f"{_span(retention.inbox)}"
        for d in done
    )
    emit(
        args,
        {
            "databases": [
                {
                    "database": d.database,
                    "published": d.published,
                    "abandoned": d.abandoned,
                    "inbox": d.inbox,
                }
                for d in done
            ]
        },
        human,
        redactor,
    )
    return EXIT_OK


async def preview(config: RouterConfig, args: argparse.Namespace, redactor: Redactor) -> int:
    from router.ops.preview import preview, preview_block, side_by_side_table

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
            headers=_pairs(args.header, "--header"),
            extensions=_pairs(args.extension, "--extension"),
        )
    except (ConfigError, StagingError) as exc:
        print(f"router: {redactor(str(exc))}", file=sys.stderr)
        return EXIT_CONFIG
    side_by_side = args.all_targets or len(previews) > 1
    human = side_by_side_table(previews) if side_by_side else preview_block(previews[0])
    emit(args, [p.as_dict() for p in previews], human, redactor)
    return EXIT_OK


async def contract(config: RouterConfig, args: argparse.Namespace, redactor: Redactor) -> int:
    from router.ops import contract

    path = Path(args.file) if getattr(args, "file", None) else config.base_dir / contract.LOCK_FILE
    try:
        catalog = load_catalog(config.events, config.base_dir)
        if args.contract_command == "export":
            print(contract.export(config, catalog, args.out), end="")
            return EXIT_OK
        if args.contract_command == "lock":
            print(contract.lock(config, catalog, path))
            return EXIT_OK
        result = contract.check(config, catalog, path)
    except ConfigError as exc:
        print(f"router: {redactor(str(exc))}", file=sys.stderr)
        return EXIT_CONFIG
    if result is None:
        print(
            f"router: no contract lock at {contract.shown(path)}; run `router contract lock`",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    emit(args, result.as_dict(), result.human(), redactor)
    return EXIT_FAILED if result.breaking else EXIT_OK


def _pairs(items: Sequence[str], option: str) -> dict[str, str]:
    pairs = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ConfigError(f"{option} takes NAME=VALUE, got {item!r}")
        pairs[name] = value
    return pairs


def _span(duration: timedelta) -> str:
    seconds = duration.total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"
