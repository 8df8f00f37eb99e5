"""``router contract``: what partners receive, exported (AsyncAPI 3.0), locked, checked."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from envelopes import ConfigError
from router._secrets import Redactor
from router.cli.output import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, emit
from router.config import RouterConfig
from router.write.catalog import load_catalog

__all__ = ["LOCK_FILE", "add_parser", "contract"]

# router.ops.contract's LOCK_FILE, for --help without importing the contract tools
# (tests/unit/test_lazy_imports.py keeps the two equal).
LOCK_FILE = "contracts.lock.json"


def add_parser(commands: Any) -> None:
    """Register ``router contract`` and its actions."""
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

    group.set_defaults(run=contract)


async def contract(config: RouterConfig, args: argparse.Namespace, redactor: Redactor) -> int:
    from router.ops import contract

    path = Path(args.file) if getattr(args, "file", None) else config.base_dir / contract.LOCK_FILE
    try:
        catalog = load_catalog(config.events, config.base_dir)
        if args.contract_command == "export":
            print(contract.export(config, catalog, args.out), end="")
            return EXIT_OK
        if args.contract_command == "lock":
            print(contract.lock(config, catalog, path))
            return EXIT_OK
        result = contract.check(config, catalog, path)
    except ConfigError as exc:
        print(f"router: {redactor(str(exc))}", file=sys.stderr)
        return EXIT_CONFIG
    if result is None:
        print(
            f"router: no contract lock at {contract.shown(path)}; run `router contract lock`",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    emit(args, result.as_dict(), result.human(), redactor)
    return EXIT_FAILED if result.breaking else EXIT_OK
