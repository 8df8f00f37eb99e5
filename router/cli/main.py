"""The ``router`` command: parse arguments, load the config, set up logging, run.

Each command imports what it uses when it runs (alembic for init-db, SQLAlchemy for the
operator commands, the contract tools...): ``router serve`` must be delivering within half a
second of its start, and most of that budget would go on imports of the other commands.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import warnings
from collections.abc import Coroutine, Sequence
from typing import Any

from envelopes import ConfigError, RouterError, SchemaError
from router._secrets import Redactor, secrets_of
from router._yaml import load_config, require_clients
from router.cli import serve
from router.cli.logs import setup_logging
from router.cli.output import EXIT_CONFIG, EXIT_FAILED, EXIT_OK
from router.cli.parser import build_parser
from router.errors import ConfigDeprecationWarning
from router.write.catalog import check_partners, load_catalog

__all__ = ["main"]

log = logging.getLogger("router")

# Commands that talk to brokers: they need every configured kind's client library. The others
# only touch databases and work with a config that names brokers this host cannot reach.
_OPENS_BROKERS = frozenset({"serve", "check"})
# Commands that import the config's events: modules and check what the config says of them
# (payload projections, pinned versions) before anything starts.
_READS_EVENTS = frozenset({"serve", "check", "preview", "contract"})


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``router`` console script and ``python -m router``."""
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ConfigDeprecationWarning)
            config = load_config(args.config)
            if args.command in _OPENS_BROKERS:
                require_clients(config, args.config)
            if args.command in _READS_EVENTS:
                check_partners(config, load_catalog(config.events, config.base_dir))
    except ConfigError as exc:
        print(f"router: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    finally:
        _report_warnings(caught)
    redactor = Redactor(secrets_of(config))
    setup_logging(args.log_level, args.log_format, redactor)
    if args.command == "serve":
        serve.prepare(config, args, main)
    try:
        return _run(args.run(config, args, redactor))
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


def _report_warnings(caught: list[warnings.WarningMessage]) -> None:
    """Log each config deprecation as ``config.deprecated``, with no Python source line (the
    reader wrote YAML); show any other warning the loading raised as Python would."""
    for warning in caught:
        if issubclass(warning.category, ConfigDeprecationWarning):
            log.warning("config.deprecated", extra={"problem": str(warning.message)})
        else:
            warnings.showwarning(
                warning.message, warning.category, warning.filename, warning.lineno
            )
    # serve checks the events: modules again as it starts: it has been said once.
    warnings.simplefilter("ignore", ConfigDeprecationWarning)


def _run(main: Coroutine[Any, Any, int]) -> int:
    """Run on uvloop where it is installed (a faster event loop), else on asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
