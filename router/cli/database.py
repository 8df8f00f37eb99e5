"""``router init-db`` and ``router check``: the tables, and whether everything is reachable."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from envelopes import RouterError
from router._secrets import Redactor
from router.cli.output import EXIT_CONFIG, EXIT_FAILED, EXIT_OK
from router.config import RouterConfig

__all__ = ["add_check", "add_init_db", "check", "init_db"]


def add_init_db(commands: Any) -> None:
    """Register ``router init-db``."""
    init_db_ = commands.add_parser("init-db", help="create or upgrade the outbox table")
    init_db_.add_argument(
        "--database", action="append", help="only this database (repeatable; default: all)"
    )
    init_db_.set_defaults(run=init_db)


def add_check(commands: Any) -> None:
    """Register ``router check``."""
    check_ = commands.add_parser(
        "check", help="validate config, reach every database and broker (changes nothing)"
    )
    check_.add_argument(
        "--create",
        action="store_true",
        help="create the streams and exchanges that serve would create",
    )
    check_.set_defaults(run=check)


async def init_db(config: RouterConfig, args: argparse.Namespace, redactor: Redactor) -> int:
    """Create or upgrade the router's tables in each database."""
    from router.ops.migrate import upgrade

    names = args.database or list(config.databases)
    unknown = sorted(set(names) - set(config.databases))
    if unknown:
        print(
            f"router: unknown database {unknown[0]!r}; configured: {sorted(config.databases)}",
            file=sys.stderr,
        )
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


async def check(config: RouterConfig, args: argparse.Namespace, redactor: Redactor) -> int:
    """Validate the config (done by now), then reach every database and broker."""
    from router.serve.check import run_checks
    from router.write.catalog import load_catalog

    print(
        f"config    {args.config}: ok ({len(config.databases)} database(s), "
        f"{len(config.brokers)} broker(s))"
    )
    # main() imported the events: modules to check the config against them: no import here.
    catalog = load_catalog(config.events, config.base_dir)
    results = await run_checks(config, create=args.create, catalog=catalog)
    width = max(len(r.name) for r in results)
    for r in results:
        status = "ok    " if r.ok else "FAILED"
        print(redactor(f"{r.kind:<9} {r.name:<{width}}  {status}  {r.address}  {r.detail}"))
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"{len(failed)} of {len(results)} checks failed")
    return EXIT_FAILED if failed else EXIT_OK
