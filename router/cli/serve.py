"""``router serve``: every processor until SIGINT, SIGTERM or SIGHUP, in one process or a
worker pool."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from collections.abc import Callable, Sequence
from typing import Any

from router._secrets import Redactor
from router.cli.arguments import instance, positive
from router.cli.output import EXIT_OK
from router.config import RouterConfig

__all__ = ["add_parsers", "prepare", "serve"]

log = logging.getLogger("router")


def add_parsers(commands: Any) -> None:
    """Register ``router serve``."""
    serve_ = commands.add_parser(
        "serve", help="run every processor until SIGINT, SIGTERM or SIGHUP"
    )
    serve_.add_argument(
        "--workers",
        type=positive,
        # A text default: argparse passes it through ``positive`` only when the option is
        # left out, so a bad $ROUTER_WORKERS is a usage error of serve, not of every command.
        default=os.environ.get("ROUTER_WORKERS", "1"),
        help="worker processes (default 1, $ROUTER_WORKERS): workers share every target, so "
        "a second one adds database work; worth it only when this process is CPU-bound "
        "and the database has cores to spare",
    )
    serve_.add_argument(
        "--instance",
        type=instance,
        help="this router's name in worker ids and lease holders, as `router status` and "
        "`router trace` show them (default: $ROUTER_INSTANCE or the host name)",
    )
    serve_.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    # A pool worker's id, picked by its parent (which frees the worker's leases by it).
    serve_.add_argument("--worker-id", help=argparse.SUPPRESS)
    serve_.set_defaults(run=serve)


def prepare(
    config: RouterConfig, args: argparse.Namespace, entry: Callable[[Sequence[str]], int]
) -> None:
    """What must happen before the event loop runs: name the instance, and make a worker
    pool, which forks its workers (running ``entry``) from a copy of this process as it is
    now (``router.serve.forkserver``)."""
    if args.instance:
        from router.serve.runner import INSTANCE

        os.environ[INSTANCE] = args.instance  # for this process and the workers it starts
    if args.workers > 1 and not args.child:
        from router.serve.workers import WorkerSupervisor

        args.pool = WorkerSupervisor(config, args.workers, _child_args(args), entry=entry)


async def serve(config: RouterConfig, args: argparse.Namespace, redactor: Redactor) -> int:
    """Run until SIGINT, SIGTERM or SIGHUP: the pool made by ``prepare``, or one process."""
    from router.serve.runner import Runner, with_pid

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # SIGHUP (the terminal closed, or a supervisor's reload) stops it as gracefully: see
    # docs/operating.md for why it does not reload the config.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(signum, _on_signal, stop, signum)
    pool = getattr(args, "pool", None)
    if pool is not None:
        await pool.run(stop)
        return EXIT_OK
    # A child of a worker pool leaves embedded brokers and HTTP to its parent.
    runner = Runner(
        config,
        worker_id=with_pid(args.worker_id, os.getpid()) if args.worker_id else None,
        start_embedded=not args.child,
        serve_http=not args.child,
        run_cleanup=not args.child,
    )
    await runner.run(stop)
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


def _on_signal(stop: asyncio.Event, signum: int) -> None:
    log.info("router.stopping", extra={"signal": signal.Signals(signum).name})
    stop.set()
