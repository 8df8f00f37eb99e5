"""The outbox's rows, for operators: ``router requeue``, ``trace``, ``pause``/``resume`` and
``cleanup``; each prints a table (or ``--json``) and returns its exit code.

Each imports what it uses when it runs (SQLAlchemy for the database queries): the parser
imports this module for every command, ``router serve`` too.
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta
from typing import Any

from router._secrets import Redactor
from router.cli.arguments import moment
from router.cli.output import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, emit
from router.config import RouterConfig

__all__ = [
    "add_cleanup",
    "add_pause_resume",
    "add_requeue",
    "add_trace",
    "cleanup",
    "pause",
    "requeue",
    "trace",
]


def add_requeue(commands: Any) -> None:
    """Register ``router requeue``."""
    requeue_ = commands.add_parser("requeue", help="put abandoned (or failed) rows back to pending")
    requeue_.add_argument("--database", help="only this database")
    requeue_.add_argument(
        "--target", action="append", default=[], help="only this target (repeatable)"
    )
    requeue_.add_argument(
        "--event-type", action="append", default=[], help="only this event type (repeatable)"
    )
    requeue_.add_argument("--error", help="only rows whose last error contains this text")
    requeue_.add_argument(
        "--since", type=moment, help="created at or after (ISO 8601 or 2h, 1d ago)"
    )
    requeue_.add_argument("--until", type=moment, help="created before (ISO 8601 or 2h, 1d ago)")
    requeue_.add_argument(
        "--failed",
        action="store_true",
        help="also rows waiting to retry (default: only abandoned ones)",
    )
    requeue_.add_argument(
        "--group", metavar="G", help="exactly the rows of failure group G (router groups)"
    )
    requeue_.add_argument("--dry-run", action="store_true", help="only count what would change")
    requeue_.add_argument("--json", action="store_true")
    requeue_.set_defaults(run=requeue)


def add_trace(commands: Any) -> None:
    """Register ``router trace``."""
    trace_ = commands.add_parser("trace", help="every target's row of one event")
    trace_.add_argument(
        "message_id",
        metavar="ID",
        help="a message id, or its first 8 hex digits or more (dashes optional)",
    )
    trace_.add_argument("--json", action="store_true")
    trace_.set_defaults(run=trace)


def add_pause_resume(commands: Any) -> None:
    """Register ``router pause`` and ``router resume``."""
    for verb, text in (
        ("pause", "stop claiming a target's rows (every worker)"),
        ("resume", "claim a paused target's rows again"),
    ):
        command = commands.add_parser(verb, help=text)
        command.add_argument("target")
        command.add_argument("--database", help="only this database")
        command.add_argument("--json", action="store_true")
        command.set_defaults(run=pause)


def add_cleanup(commands: Any) -> None:
    """Register ``router cleanup``."""
    cleanup_ = commands.add_parser("cleanup", help="delete rows past their retention")
    cleanup_.add_argument("--database", help="only this database")
    cleanup_.add_argument("--json", action="store_true")
    cleanup_.set_defaults(run=cleanup)


async def requeue(config: RouterConfig, args: argparse.Namespace, redactor: Redactor) -> int:
    from router.ops import outbox
    from router.ops.audit import cli_actor

    if args.group:
        from router.cli.groups import requeue_group

        return await requeue_group(config, args, redactor)
    statuses = ("abandoned", "failed") if args.failed else ("abandoned",)
    counts = await outbox.requeue(
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
    from router.ops import outbox

    ids = await outbox.matching_ids(config, args.message_id, _SHOWN_MATCHES)
    if len(ids) > 1:
        _print_matches(args.message_id, ids)
        return EXIT_CONFIG
    message_id = ids[0] if ids else args.message_id
    rows = await outbox.trace(config, message_id) if ids else []
    if not rows and not args.json:
        print(f"no outbox row has message id {args.message_id}")
        return EXIT_FAILED
    blocks = [f"message {message_id} ({rows[0].event_type})"] if rows else []
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
        {"message_id": message_id, "rows": [r.as_dict() for r in rows]},
        redactor("\n".join(blocks)),
        redactor,
    )
    return EXIT_OK if rows else EXIT_FAILED


_SHOWN_MATCHES = 10


def _print_matches(prefix: str, ids: list[str]) -> None:
    """An ambiguous prefix: the events it matches, to pick from."""
    more = len(ids) > _SHOWN_MATCHES
    count = f"more than {_SHOWN_MATCHES}" if more else str(len(ids))
    print(f"router: {prefix} matches {count} events; give more of the id:", file=sys.stderr)
    for found in ids[:_SHOWN_MATCHES]:
        print(f"  {found}", file=sys.stderr)


def _receipt_text(receipt: dict[str, Any] | None) -> str | None:
    """``stream=EVENTS seq=12``: the broker's receipt, one line."""
    if not receipt:
        return None
    return " ".join(f"{key}={value}" for key, value in receipt.items())


async def pause(config: RouterConfig, args: argparse.Namespace, redactor: Redactor) -> int:
    from router.ops import outbox
    from router.ops.audit import cli_actor

    paused = args.command == "pause"
    by = cli_actor()
    databases = await outbox.set_paused(
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
    from router.ops import outbox

    done = await outbox.cleanup(config, args.database)
    retention = config.outbox.retention
    human = "\n".join(
        f"{d.database}: deleted {d.published} published row(s) older than "
        f"{_span(retention.published)}, {d.abandoned} abandoned row(s) older than "
        f"{_span(retention.abandoned)}, {d.inbox} inbox record(s) older than "
        f"{_span(retention.inbox)}, {d.gaps} gap marker(s) older than "
        f"{_span(retention.abandoned)}"
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
                    "gaps": d.gaps,
                }
                for d in done
            ]
        },
        human,
        redactor,
    )
    return EXIT_OK


def _span(duration: timedelta) -> str:
    seconds = duration.total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"
