"""The ``router`` command: parse arguments, load the config, set up logging, run.

router serve       run every processor until SIGINT/SIGTERM (--workers N: N processes)
router init-db     create or upgrade the outbox table in every database
router check       validate the config and reach every database and broker (--create)
router status      backlog, failures and circuits per target (--json)
router groups      failed and abandoned rows grouped by what went wrong
router requeue     abandoned (or failed) rows back to pending, with filters or --group (--dry-run)
router discard     delete a failure group's rows: they will never be sent (--dry-run)
router trace ID    every target's row of one event
router pause T     stop claiming target T (every worker); router resume T undoes it
router cleanup     delete published and abandoned rows past their retention
router audit       who requeued, discarded, paused or resumed what, newest first
router preview T   the exact message each target would receive for an event of type T
router contract    what partners receive: export (AsyncAPI 3.0), lock, check against the lock
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import sys
from collections.abc import Coroutine, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from envelopes import ConfigError, RouterError, SchemaError
from router import __version__
from router._secrets import Redactor, secrets_of
from router._yaml import load_config, require_clients
from router.config import RouterConfig
from router.ops import commands, commands_groups, commands_replay, commands_status
from router.ops._logs import setup_logging
from router.ops.commands import EXIT_CONFIG, EXIT_FAILED, EXIT_OK
from router.write.catalog import check_partners, load_catalog

# Each command imports what it uses when it runs (alembic for init-db, SQLAlchemy for the
# operator commands, the contract tools...): `router serve` must be delivering within half a
# second of its start, and most of that budget would go on imports of the other commands.

__all__ = ["main"]

log = logging.getLogger("router")


# Commands that talk to brokers: they need every configured kind's client library. The others
# only touch databases and work with a config that names brokers this host cannot reach.
_OPENS_BROKERS = frozenset({"serve", "check"})
# Commands that import the config's events: modules and check what the config says of them
# (payload projections, pinned versions) before anything starts.
_READS_EVENTS = frozenset({"serve", "check", "preview", "contract"})
# router.ops.contract's LOCK_FILE, for --help without importing the contract tools
# (tests/unit/test_lazy_imports.py keeps the two equal).
LOCK_FILE = "contracts.lock.json"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``router`` console script and ``python -m router``."""
    args = _parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    try:
        config = load_config(args.config)
        if args.command in _OPENS_BROKERS:
            require_clients(config, args.config)
        if args.command in _READS_EVENTS:
            check_partners(config, load_catalog(config.events, config.base_dir))
    except ConfigError as exc:
        print(f"router: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    redactor = Redactor(secrets_of(config))
    setup_logging(args.log_level, args.log_format, redactor)
    if args.command == "serve" and args.instance:
        from router.ops.supervisor import INSTANCE

        os.environ[INSTANCE] = args.instance  # for this process and the workers it starts
    if args.command == "serve" and args.workers > 1 and not args.child:
        # Made before the event loop runs: the pool forks its workers from a copy of this
        # process as it is now (router.ops.forkserver).
        from router.ops.workers import WorkerPool

        args.pool = WorkerPool(config, args.workers, _child_args(args))
    command = {
        "serve": _serve,
        "init-db": _init_db,
        "check": _check,
        "status": commands_status.status,
        "groups": commands_groups.groups,
        "requeue": commands.requeue,
        "discard": commands_groups.discard,
        "replay": commands_replay.replay,
        "trace": commands.trace,
        "pause": commands.pause,
        "resume": commands.pause,
        "cleanup": commands.cleanup,
        "audit": commands_groups.audit,
        "preview": commands.preview,
        "contract": commands.contract,
    }[args.command]
    try:
        return _run(command(config, args, redactor))
    except (SchemaError, ConfigError) as exc:
        # Not a passing fault: nothing will work until the operator runs init-db or fixes
        # the config (a serve that checks the events: modules only as it starts, say).
        print(f"router: {redactor(str(exc))}", file=sys.stderr)
        return EXIT_CONFIG
    except RouterError as exc:
        print(f"router: {redactor(str(exc))}", file=sys.stderr)
        return EXIT_FAILED
    except BrokenPipeError:
        # The reader went away (router preview ... | head): not an error of ours. Python
        # would complain again flushing stdout at exit; point it at /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except KeyboardInterrupt:  # pragma: no cover - serve handles SIGINT itself
        return 130


def _run(main: Coroutine[Any, Any, int]) -> int:
    """Run on uvloop where it is installed (a faster event loop), else on asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="router", description="Reliable event publishing from databases to brokers."
    )
    parser.add_argument("--version", action="version", version=f"outbox-router {__version__}")
    parser.add_argument(
        "-c",
        "--config",
        default=os.environ.get("ROUTER_CONFIG", "config.yaml"),
        help="config file (default: $ROUTER_CONFIG or ./config.yaml)",
    )
    parser.add_argument(
        "--log-level",
        default=os.environ.get("ROUTER_LOG_LEVEL", "info"),
        choices=["debug", "info", "warning", "error"],
    )
    parser.add_argument(
        "--log-format",
        default=os.environ.get("ROUTER_LOG_FORMAT", "text"),
        choices=["text", "json"],
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser("serve", help="run every processor until SIGINT/SIGTERM")
    serve.add_argument(
        "--workers",
        type=_positive,
        default=int(os.environ.get("ROUTER_WORKERS", "1")),
        help="worker processes (default 1, $ROUTER_WORKERS): workers share every target, so "
        "a second one adds database work; worth it only when this process is CPU-bound "
        "and the database has cores to spare",
    )
    serve.add_argument(
        "--instance",
        type=_instance,
        help="this router's name in worker ids and lease holders, as `router status` and "
        "`router trace` show them (default: $ROUTER_INSTANCE or the host name)",
    )
    serve.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    # A pool worker's id, picked by its parent (which frees the worker's leases by it).
    serve.add_argument("--worker-id", help=argparse.SUPPRESS)
    init_db = commands.add_parser("init-db", help="create or upgrade the outbox table")
    init_db.add_argument(
        "--database", action="append", help="only this database (repeatable; default: all)"
    )
    check = commands.add_parser(
        "check", help="validate config, reach every database and broker (changes nothing)"
    )
    check.add_argument(
        "--create",
        action="store_true",
        help="create the streams and exchanges that serve would create",
    )

    commands_status.add_parser(commands)

    groups = commands.add_parser(
        "groups", help="failed and abandoned rows grouped by what went wrong"
    )
    groups.add_argument("--database", help="only this database")
    groups.add_argument("--target", help="only this target")
    groups.add_argument("--json", action="store_true")

    requeue = commands.add_parser("requeue", help="put abandoned (or failed) rows back to pending")
    requeue.add_argument("--database", help="only this database")
    requeue.add_argument(
        "--target", action="append", default=[], help="only this target (repeatable)"
    )
    requeue.add_argument(
        "--event-type", action="append", default=[], help="only this event type (repeatable)"
    )
    requeue.add_argument("--error", help="only rows whose last error contains this text")
    requeue.add_argument(
        "--since", type=_moment, help="created at or after (ISO 8601 or 2h, 1d ago)"
    )
    requeue.add_argument("--until", type=_moment, help="created before (ISO 8601 or 2h, 1d ago)")
    requeue.add_argument(
        "--failed",
        action="store_true",
        help="also rows waiting to retry (default: only abandoned ones)",
    )
    requeue.add_argument(
        "--group", metavar="G", help="exactly the rows of failure group G (router groups)"
    )
    requeue.add_argument("--dry-run", action="store_true", help="only count what would change")
    requeue.add_argument("--json", action="store_true")

    discard = commands.add_parser(
        "discard", help="delete a failure group's rows: they will never be sent"
    )
    discard.add_argument(
        "--group", metavar="G", required=True, help="the failure group (router groups)"
    )
    discard.add_argument("--database", help="only look for the group in this database")
    discard.add_argument("--dry-run", action="store_true", help="only count what would go")
    discard.add_argument("--json", action="store_true")

    commands_replay.add_parser(commands, _moment)

    trace = commands.add_parser("trace", help="every target's row of one event")
    trace.add_argument("message_id")
    trace.add_argument("--json", action="store_true")

    for verb, text in (
        ("pause", "stop claiming a target's rows (every worker)"),
        ("resume", "claim a paused target's rows again"),
    ):
        command = commands.add_parser(verb, help=text)
        command.add_argument("target")
        command.add_argument("--database", help="only this database")
        command.add_argument("--json", action="store_true")

    cleanup = commands.add_parser("cleanup", help="delete rows past their retention")
    cleanup.add_argument("--database", help="only this database")
    cleanup.add_argument("--json", action="store_true")

    audit = commands.add_parser("audit", help="who requeued, discarded, paused or resumed what")
    audit.add_argument("--database", help="only this database")
    audit.add_argument(
        "--limit", type=_positive, default=50, help="the latest N actions (default 50)"
    )
    audit.add_argument("--json", action="store_true")

    preview = commands.add_parser(
        "preview", help="the exact message each target would get for an event"
    )
    preview.add_argument("event_type", metavar="EVENT_TYPE")
    preview.add_argument(
        "--target", action="append", help="this target only (repeatable; default: all of them)"
    )
    preview.add_argument(
        "--all-targets", action="store_true", help="every target of the event, side by side"
    )
    given = preview.add_mutually_exclusive_group()
    given.add_argument("--payload", metavar="JSON", help="the event's fields as JSON")
    given.add_argument(
        "--example", action="store_true", help="an example made from the event class (default)"
    )
    preview.add_argument("--version", type=_positive, help="this version of the event type")
    preview.add_argument("--database", help="as staged in this database")
    preview.add_argument("--stream-key", help="the stream key to stage with")
    preview.add_argument(
        "--header", action="append", default=[], metavar="NAME=VALUE", help="a staged header"
    )
    preview.add_argument(
        "--extension", action="append", default=[], metavar="NAME=VALUE", help="an extension"
    )
    preview.add_argument("--json", action="store_true")
    _contract_parser(commands)
    return parser


def _contract_parser(commands: Any) -> None:
    group = commands.add_parser(
        "contract",
        help="what partners receive: export, lock, check (internal brokers are not in it)",
        description="The partner contract: per partner broker, each published event version "
        "it receives, its destination, envelope, headers and payload schema. Internal brokers "
        "are not in it: what the owning system's own broker gets is no partner's contract.",
    )
    actions = group.add_subparsers(dest="contract_command", required=True, metavar="ACTION")
    export = actions.add_parser(
        "export",
        help="the contract as an AsyncAPI 3.0 document",
        description="Write the partner contract as an AsyncAPI 3.0 document: a server per "
        "partner broker, a channel per destination, a message per event version. Internal "
        "brokers are not in it.",
    )
    export.add_argument(
        "--out",
        metavar="FILE",
        help="write to FILE (YAML if it ends in .yaml or .yml; default: JSON on stdout)",
    )
    lock_file = f"the lock file (default: {LOCK_FILE} next to the config)"
    lock = actions.add_parser("lock", help="write the contract to the lock file, to commit")
    lock.add_argument("--file", metavar="FILE", help=lock_file)
    verify = actions.add_parser(
        "check",
        help="compare the contract with the lock: exit 1 on a breaking change",
        description="Compare the contract of the code and config with the lock. Exit 0 when "
        "nothing changed or only additively, 1 on a breaking change to an event version "
        "partners already get, 2 without a lock.",
    )
    verify.add_argument("--file", metavar="FILE", help=lock_file)
    verify.add_argument("--json", action="store_true")


async def _serve(config: RouterConfig, args: argparse.Namespace, redactor: Redactor) -> int:
    from router.ops.supervisor import Supervisor, with_pid

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, _on_signal, stop, signum)
    pool = getattr(args, "pool", None)
    if pool is not None:
        await pool.run(stop)
        return EXIT_OK
    # A child of a worker pool leaves embedded brokers and HTTP to its parent.
    supervisor = Supervisor(
        config,
        worker_id=with_pid(args.worker_id, os.getpid()) if args.worker_id else None,
        start_embedded=not args.child,
        serve_http=not args.child,
        run_cleanup=not args.child,
    )
    await supervisor.run(stop)
    return EXIT_OK


def _child_args(args: argparse.Namespace) -> list[str]:
    """The command line of a pool's worker (``--worker-id`` is added per worker)."""
    return [
        "-c",
        args.config,
        "--log-level",
        args.log_level,
        "--log-format",
        args.log_format,
        "serve",
        "--child",
    ]


def _instance(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", text):
        raise argparse.ArgumentTypeError(
            "up to 63 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return text


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _on_signal(stop: asyncio.Event, signum: int) -> None:
    log.info("router.stopping", extra={"signal": signal.Signals(signum).name})
    stop.set()


async def _init_db(config: RouterConfig, args: argparse.Namespace, redactor: Redactor) -> int:
    from router.ops.migrate import upgrade

    names = args.database or list(config.databases)
    unknown = sorted(set(names) - set(config.databases))
    if unknown:
        print(f"router: unknown database(s) {unknown}", file=sys.stderr)
        return EXIT_CONFIG
    failed = False
    for name in names:
        database = config.databases[name]
        try:
            result = await upgrade(name, database, config.base_dir)
        except RouterError as exc:
            print(f"{name}: FAILED {redactor(str(exc))}")
            failed = True
            continue
        state = (
            f"upgraded {result.before or 'empty'} -> {result.after}"
            if result.changed
            else f"already at {result.after}, nothing to do"
        )
        print(f"{name}: {state} ({database.public_url()})")
    return EXIT_FAILED if failed else EXIT_OK


async def _check(config: RouterConfig, args: argparse.Namespace, redactor: Redactor) -> int:
    from router.ops.check import run_checks

    print(
        f"config    {args.config}: ok ({len(config.databases)} database(s), "
        f"{len(config.brokers)} broker(s))"
    )
    results = await run_checks(config, create=args.create)
    width = max(len(r.name) for r in results)
    for r in results:
        status = "ok    " if r.ok else "FAILED"
        print(redactor(f"{r.kind:<9} {r.name:<{width}}  {status}  {r.address}  {r.detail}"))
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"{len(failed)} of {len(results)} checks failed")
    return EXIT_FAILED if failed else EXIT_OK


def _moment(text: str) -> datetime:
    """ISO 8601, or a duration ago: 30m, 2h, 1d, 1w."""
    units = {"m": 60, "h": 3600, "d": 86400, "w": 604800}
    value = text.strip()
    if value and value[-1] in units and value[:-1].isdigit():
        return datetime.now(UTC) - timedelta(seconds=int(value[:-1]) * units[value[-1]])
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use ISO 8601 or 30m, 2h, 1d, 1w") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)
