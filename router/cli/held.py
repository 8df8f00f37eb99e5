"""The held and parked stream keys of ``router``: ``held`` lists them, ``release`` lets one go
(or a failure group's); each prints a table (or ``--json``) and returns its exit code.

Like the other commands, each imports what it uses when it runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from router._secrets import Redactor
from router.cli.output import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, emit, table
from router.config import RouterConfig

if TYPE_CHECKING:
    from router.ops.held import Released

__all__ = ["add_held", "add_release", "held", "release"]


def add_held(commands: Any) -> None:
    """Register ``router held``."""
    held_ = commands.add_parser(
        "held", help="stream keys held or parked per target, waiting for router release"
    )
    held_.add_argument("target", nargs="?", help="only this target")
    held_.add_argument("--database", help="only this database")
    held_.add_argument("--json", action="store_true")
    held_.set_defaults(run=held)


def add_release(commands: Any) -> None:
    """Register ``router release``."""
    release_ = commands.add_parser(
        "release",
        help="let a held or parked stream key go: retry its head, or drop it (--drop)",
    )
    release_.add_argument("target", nargs="?", help="the target the key waits on")
    release_.add_argument("key", nargs="?", help="the stream key")
    release_.add_argument(
        "--group",
        metavar="G",
        help="instead of TARGET KEY: every key whose head failed as failure group G's rows did",
    )
    release_.add_argument(
        "--drop",
        action="store_true",
        help="abandon the head (the next message on the key names it) and send the rest",
    )
    release_.add_argument("--reason", required=True, help="why, for the audit trail")
    release_.add_argument("--database", help="only this database")
    release_.add_argument("--json", action="store_true")
    release_.set_defaults(run=release)


async def held(config: RouterConfig, args: argparse.Namespace, redactor: Redactor) -> int:
    from router.ops.held import held_keys

    found = await held_keys(config, args.target, args.database)
    header = ["database", "target", "key", "status", "behind", "age", "head", "group", "error"]
    rows = [
        (
            k.database,
            k.target,
            k.stream_key,
            k.status,
            k.behind,
            _age(k.age_seconds),
            k.message_id,
            k.group,
            k.last_error,
        )
        for k in found
    ]
    human = table(header, rows, right=4) if found else "no held or parked stream keys"
    emit(args, {"keys": [k.as_dict() for k in found]}, redactor(human), redactor)
    return EXIT_OK


def _age(seconds: float | None) -> str | None:
    """``3d4h``, ``2h5m``, ``4m10s``, ``12s``: how long a key has waited, roughly."""
    if seconds is None:
        return None
    left = int(seconds)
    parts: list[str] = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if left >= size or (unit == "s" and not parts):
            parts.append(f"{left // size}{unit}")
            left %= size
    return "".join(parts[:2])


async def release(config: RouterConfig, args: argparse.Namespace, redactor: Redactor) -> int:
    from router.ops import held as ops
    from router.ops.audit import cli_actor

    if args.group and (args.target or args.key):
        print("router: --group picks its keys itself; drop TARGET and KEY", file=sys.stderr)
        return EXIT_CONFIG
    if not args.group and not (args.target and args.key):
        print("router: release takes TARGET KEY, or --group G", file=sys.stderr)
        return EXIT_CONFIG
    if args.group:
        from router.ops.groups import find_group

        group = await find_group(config, args.group, args.database)
        if group is None:
            print(
                f"router: no failure group {args.group} (router groups lists them)", file=sys.stderr
            )
            return EXIT_FAILED
        done = await ops.release_group(
            config, group, drop=args.drop, reason=args.reason, actor=cli_actor()
        )
        missing = f"no held or parked key of {group.target} failed as group {group.id}"
    else:
        done = await ops.release(
            config,
            args.target,
            args.key,
            drop=args.drop,
            reason=args.reason,
            actor=cli_actor(),
            database=args.database,
        )
        missing = f"{args.key!r} is not held or parked on {args.target}"
    if not done and not args.json:
        print(f"router: {missing} (router held lists them)", file=sys.stderr)
        return EXIT_FAILED
    emit(args, {"released": [r.as_dict() for r in done]}, _lines(done), redactor)
    return EXIT_OK if done else EXIT_FAILED


def _lines(done: list[Released]) -> str:
    """One line per key released."""
    return "\n".join(
        f"{r.database}/{r.target} {r.stream_key}: "
        + (f"dropped {r.message_id}" if r.dropped else f"retrying {r.message_id}")
        + f", {r.rows} row(s) back to pending"
        for r in done
    )
