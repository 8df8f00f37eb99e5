"""The ``router`` command line: the global options, then each command's own sub-parser,
added by the module that runs it (each sets ``run``, the coroutine function of the command).

router serve       run every processor until SIGINT/SIGTERM/SIGHUP (--workers N: N processes)
router init-db     create or upgrade the outbox table in every database
router check       validate the config and reach every database and broker (--create)
router status      backlog, failures and circuits per target (--json)
router groups      failed and abandoned rows grouped by what went wrong
router requeue     abandoned (or failed) rows back to pending, with filters or --group (--dry-run)
router discard     delete a failure group's rows: they will never be sent (--dry-run)
router held        stream keys held or parked per target (ordering: hold, park)
router release     let a held or parked key go: retry its head, or --drop it (--group G)
router replay      send a target's retained events again, or backfill a new target
router trace ID    every target's row of one event
router pause T     stop claiming target T (every worker); router resume T undoes it
router cleanup     delete published and abandoned rows past their retention
router audit       who requeued, discarded, released, paused or resumed what, newest first
router preview T   the exact message each target would receive for an event of type T
router contract    what partners receive: export (AsyncAPI 3.0), lock, check against the lock
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from router import __version__
from router.cli import contract, database, groups, held, outbox, preview, replay, serve, status

__all__ = ["build_parser"]

# The order of `router --help`: running, then looking, then acting, then the partner tools.
REGISTER: tuple[Callable[[Any], None], ...] = (
    serve.add_parsers,
    database.add_init_db,
    database.add_check,
    status.add_parser,
    groups.add_groups,
    outbox.add_requeue,
    groups.add_discard,
    held.add_held,
    held.add_release,
    replay.add_parser,
    outbox.add_trace,
    outbox.add_pause_resume,
    outbox.add_cleanup,
    groups.add_audit,
    preview.add_parser,
    contract.add_parser,
)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``router``: global options and every command."""
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
    for register in REGISTER:
        register(commands)
    return parser
