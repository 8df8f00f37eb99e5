"""The failure-group commands of ``router`` and the audit trail: groups, requeue --group,
discard, audit; each printing a table (or ``--json``) and returning its exit code.

Like the other commands, each imports what it uses when it runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from router._secrets import Redactor
from router.cli.arguments import positive
from router.cli.output import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, emit, table
from router.config import RouterConfig

if TYPE_CHECKING:
    from router.ops.groups import FailureGroup

__all__ = [
    "add_audit",
    "add_discard",
    "add_groups",
    "audit",
    "discard",
    "groups",
    "requeue_group",
]


def add_groups(commands: Any) -> None:
    """Register ``router groups``."""
    groups_ = commands.add_parser(
        "groups", help="failed and abandoned rows grouped by what went wrong"
    )
    groups_.add_argument("--database", help="only this database")
    groups_.add_argument("--target", help="only this target")
    groups_.add_argument("--json", action="store_true")
    groups_.set_defaults(run=groups)


def add_discard(commands: Any) -> None:
    """Register ``router discard``."""
    discard_ = commands.add_parser(
        "discard", help="delete a failure group's rows: they will never be sent"
    )
    discard_.add_argument(
        "--group", metavar="G", required=True, help="the failure group (router groups)"
    )
    discard_.add_argument("--database", help="only look for the group in this database")
    discard_.add_argument("--dry-run", action="store_true", help="only count what would go")
    discard_.add_argument("--json", action="store_true")
    discard_.set_defaults(run=discard)


def add_audit(commands: Any) -> None:
    """Register ``router audit``."""
    audit_ = commands.add_parser(
        "audit", help="who requeued, discarded, released, paused or resumed what"
    )
    audit_.add_argument("--database", help="only this database")
    audit_.add_argument(
        "--limit", type=positive, default=50, help="the latest N actions (default 50)"
    )
    audit_.add_argument("--json", action="store_true")
    audit_.set_defaults(run=audit)


async def groups(config: RouterConfig, args: argparse.Namespace, redactor: Redactor) -> int:
    from router.ops.groups import list_groups

    found = await list_groups(config, args.database, args.target)
    header = [
        "id",
        "database",
        "target",
        "class",
        "code",
        "count",
        "failed",
        "abandoned",
        "first seen",
        "last seen",
        "message",
    ]
    rows = [
        (
            g.id,
            g.database,
            g.target,
            g.error_class,
            g.code,
            g.count,
            g.statuses["failed"],
            g.statuses["abandoned"],
            _moment(g.first_seen),
            _moment(g.last_seen),
            g.message,
        )
        for g in found
    ]
    human = table(header, rows, right=5) if found else "no failed or abandoned rows"
    emit(args, {"groups": [g.as_dict() for g in found]}, redactor(human), redactor)
    return EXIT_OK


def _moment(text: str | None) -> str | None:
    """``2026-11-24 02:40:10``: to the second, in UTC, for a table."""
    return text[:19].replace("T", " ") if text else None


async def _group(config: RouterConfig, args: argparse.Namespace) -> FailureGroup | None:
    from router.ops.groups import find_group

    found = await find_group(config, args.group, args.database)
    if found is None:
        print(f"router: no failure group {args.group} (router groups lists them)", file=sys.stderr)
    return found


# requeue's filters, which --group replaces: a group's rows are exactly its own.
_FILTERS = (
    ("--target", "target"),
    ("--event-type", "event_type"),
    ("--error", "error"),
    ("--since", "since"),
    ("--until", "until"),
    ("--failed", "failed"),
)


async def requeue_group(config: RouterConfig, args: argparse.Namespace, redactor: Redactor) -> int:
    """``router requeue --group G``: the group's failed and abandoned rows back to pending."""
    from router.ops.audit import cli_actor
    from router.ops.groups import requeue_group as requeue_rows

    given = [option for option, name in _FILTERS if getattr(args, name)]
    if given:
        print(f"router: --group picks its rows itself; drop {', '.join(given)}", file=sys.stderr)
        return EXIT_CONFIG
    group = await _group(config, args)
    if group is None:
        return EXIT_FAILED
    count = await requeue_rows(config, group, dry_run=args.dry_run, actor=cli_actor())
    _counted(args, group, count, "would requeue" if args.dry_run else "requeued", redactor)
    return EXIT_OK


async def discard(config: RouterConfig, args: argparse.Namespace, redactor: Redactor) -> int:
    from router.ops.audit import cli_actor
    from router.ops.groups import discard as discard_rows

    group = await _group(config, args)
    if group is None:
        return EXIT_FAILED
    count = await discard_rows(config, group, dry_run=args.dry_run, actor=cli_actor())
    _counted(args, group, count, "would discard" if args.dry_run else "discarded", redactor)
    return EXIT_OK


def _counted(
    args: argparse.Namespace, group: FailureGroup, count: int, verb: str, redactor: Redactor
) -> None:
    """``main: requeued 3 row(s)``, as ``router requeue`` says it."""
    rows = {group.database: count}
    document = {"dry_run": args.dry_run, "group": group.id, "rows": rows, "total": count}
    emit(args, document, f"{group.database}: {verb} {count} row(s)", redactor)


async def audit(config: RouterConfig, args: argparse.Namespace, redactor: Redactor) -> int:
    from router.ops.audit import history

    rows = await history(config, args.database, args.limit)
    human = table(
        ["at", "database", "actor", "action", "target", "rows", "detail"],
        [
            (_moment(r.at), r.database, r.actor, r.action, r.target, r.row_count, _detail(r.detail))
            for r in rows
        ],
        right=5,
    )
    emit(
        args,
        {"actions": [r.as_dict() for r in rows]},
        redactor(human if rows else "no actions"),
        redactor,
    )
    return EXIT_OK


def _detail(detail: dict[str, Any]) -> str:
    """``group=3f9c0a1b2d target=partner ...``: an audit row's detail on one line, the
    message ids counted rather than listed."""
    words = []
    for key, value in sorted(detail.items()):
        if value in (None, "", [], {}):
            continue
        if key == "message_ids":
            words.append(f"message_ids={len(value)}")
        elif isinstance(value, list):
            words.append(f"{key}={','.join(str(v) for v in value)}")
        else:
            words.append(f"{key}={value}")
    return " ".join(words)
