"""``router replay``: send retained events to one target again, or backfill a new target.

Progress goes to the terminal as one redrawn line, or as JSON lines when the output is not a
terminal (a log, a pipe, CI), so a long replay can be watched and parsed alike.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any, TextIO

from router._secrets import Redactor
from router.cli.arguments import moment
from router.cli.output import EXIT_OK
from router.config import RouterConfig

__all__ = ["add_parser", "replay"]


def add_parser(commands: Any) -> None:
    """Register ``router replay``."""
    replay_ = commands.add_parser(
        "replay",
        help="send a target's retained events again, or backfill a new target",
        description="Put a target's published rows (kept for retention.published) back in its "
        "queue, in outbox order and paced, so they go out again with their original message "
        "ids; with --backfill, give a new target a row for every retained event of its "
        "database it would have been sent. Resumable: --resume ID continues the replay that "
        "audit row ID started.",
    )
    replay_.add_argument("--target", help="the target to send to")
    replay_.add_argument("--database", help="the database (default: the only one)")
    replay_.add_argument(
        "--backfill",
        action="store_true",
        help="copy events retained for other targets that this target has no row for "
        "(needs the config's events: modules)",
    )
    replay_.add_argument("--since", type=moment, help="created at or after (ISO 8601 or 2h ago)")
    replay_.add_argument("--until", type=moment, help="created before (ISO 8601 or 2h ago)")
    replay_.add_argument(
        "--type", action="append", default=[], dest="event_types", help="this event type only"
    )
    replay_.add_argument("--rate", type=_rate, help="rows per second (default: as fast as it can)")
    replay_.add_argument("--resume", type=int, metavar="AUDIT_ID", help="continue this replay")
    replay_.add_argument("--dry-run", action="store_true", help="only count")
    replay_.add_argument("--json", action="store_true", help="JSON lines, even on a terminal")
    replay_.set_defaults(run=replay)


def _rate(text: str) -> float:
    value = text.removesuffix("/s")
    try:
        rate = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of rows per second") from None
    if rate <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be above 0")
    return rate


async def replay(config: RouterConfig, args: argparse.Namespace, redactor: Redactor) -> int:
    from envelopes import ConfigError
    from router.ops.audit import cli_actor
    from router.ops.replay import Progress, ReplayPlan, replay, resume_plan

    database = args.database or _only_database(config)
    if args.resume is not None:
        plan = await resume_plan(config, database, args.resume)
    elif not args.target:
        raise ConfigError("replay needs --target (or --resume AUDIT_ID)")
    else:
        plan = ReplayPlan(
            database=database,
            target=args.target,
            backfill=args.backfill,
            since=args.since,
            until=args.until,
            event_types=tuple(args.event_types),
            rate=args.rate,
        )
    verb = "backfill" if plan.backfill else "replay"
    lines = args.json or not sys.stderr.isatty()
    report = _json_lines(sys.stdout) if lines else _bar(sys.stderr)
    progress: Progress = await replay(
        config,
        plan,
        actor=cli_actor(),
        dry_run=args.dry_run,
        report=None if args.dry_run else report,
        resumed_from=args.resume,
    )
    if not lines and not args.dry_run:
        sys.stderr.write("\n")
    summary = progress.as_dict() | {"event": "done", "database": database, "target": plan.target}
    if args.dry_run:
        human = f"{database}: would {verb} {progress.total:,} row(s) to {plan.target}"
    else:
        human = (
            f"{database}: {verb}ed {progress.done:,} row(s) to {plan.target} in "
            f"{progress.elapsed:.1f} s (audit #{progress.audit_id})"
        )
        if progress.skipped:
            human += f"; {progress.skipped:,} event(s) are not for this target"
    # A run that reported JSON lines ends with one more; a dry run reports nothing before.
    as_json = args.json or (lines and not args.dry_run)
    print(redactor(json.dumps(summary, default=str) if as_json else human))
    return EXIT_OK


def _only_database(config: RouterConfig) -> str:
    from envelopes import ConfigError

    if len(config.databases) != 1:
        raise ConfigError(f"name the database: --database {' | '.join(config.databases)}")
    return next(iter(config.databases))


def _json_lines(out: TextIO) -> Callable[[Any], None]:
    def report(progress: Any) -> None:
        out.write(json.dumps({"event": "progress", **progress.as_dict()}) + "\n")
        out.flush()

    return report


def _bar(out: TextIO, width: int = 30) -> Callable[[Any], None]:
    """One line redrawn in place: bar, rows, percent, rate, time left."""

    def report(progress: Any) -> None:
        total = max(progress.total, progress.done, 1)
        filled = int(width * progress.done / total)
        rate = progress.done / progress.elapsed if progress.elapsed > 0 else 0.0
        left = (total - progress.done) / rate if rate > 0 else 0.0
        out.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {progress.done:,}/{total:,} "
            f"{100 * progress.done / total:3.0f}%  {rate:,.0f}/s  {left:4.1f} s left "
        )
        out.flush()

    return report
