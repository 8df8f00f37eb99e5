"""The ``router`` command: parse arguments, load the config, set up logging, run.

router serve       run every processor until SIGINT/SIGTERM (--workers N: N processes)
router init-db     create or upgrade the outbox table in every database
router check       validate the config and reach every database and broker
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Coroutine, Sequence
from typing import Any

from envelopes import ConfigError, RouterError
from router import __version__
from router._logs import setup_logging
from router._secrets import Redactor, secrets_of
from router._yaml import load_config
from router.check import run_checks
from router.config import RouterConfig
from router.migrate import upgrade
from router.supervisor import Supervisor
from router.workers import WorkerPool

__all__ = ["main"]

log = logging.getLogger("router")

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``router`` console script and ``python -m router``."""
    args = _parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"router: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    redactor = Redactor(secrets_of(config))
    setup_logging(args.log_level, args.log_format, redactor)
    command = {"serve": _serve, "init-db": _init_db, "check": _check}[args.command]
    try:
        return _run(command(config, args, redactor))
    except RouterError as exc:
        print(f"router: {redactor(str(exc))}", file=sys.stderr)
        return EXIT_FAILED
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
        help="worker processes (default 1; $ROUTER_WORKERS)",
    )
    serve.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    init_db = commands.add_parser("init-db", help="create or upgrade the outbox table")
    init_db.add_argument(
        "--database", action="append", help="only this database (repeatable; default: all)"
    )
    commands.add_parser("check", help="validate config, reach every database and broker")
    return parser


async def _serve(config: RouterConfig, args: argparse.Namespace, redactor: Redactor) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, _on_signal, stop, signum)
    if args.workers > 1 and not args.child:
        child = [
            "-c",
            args.config,
            "--log-level",
            args.log_level,
            "--log-format",
            args.log_format,
            "serve",
            "--child",
        ]
        await WorkerPool(config, args.workers, child).run(stop)
        return EXIT_OK
    # A child of a worker pool leaves embedded brokers and HTTP to its parent.
    supervisor = Supervisor(config, start_embedded=not args.child, serve_http=not args.child)
    await supervisor.run(stop)
    return EXIT_OK


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _on_signal(stop: asyncio.Event, signum: int) -> None:
    log.info("router.stopping", extra={"signal": signal.Signals(signum).name})
    stop.set()


async def _init_db(config: RouterConfig, args: argparse.Namespace, redactor: Redactor) -> int:
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
    print(
        f"config    {args.config}: ok ({len(config.databases)} database(s), "
        f"{len(config.brokers)} broker(s))"
    )
    results = await run_checks(config)
    width = max(len(r.name) for r in results)
    for r in results:
        status = "ok    " if r.ok else "FAILED"
        print(redactor(f"{r.kind:<9} {r.name:<{width}}  {status}  {r.address}  {r.detail}"))
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"{len(failed)} of {len(results)} checks failed")
    return EXIT_FAILED if failed else EXIT_OK
