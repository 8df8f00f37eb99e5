"""``router status``: the backlog, failures, flow and limits of every target, once or
redrawn every few seconds (``--watch``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from router._secrets import Redactor
from router.cli.output import EXIT_OK, table
from router.config import RouterConfig

__all__ = ["add_parser", "status"]

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear the screen
PROBED = "as a relay starting now would pick it (a running one's: serve's /api/outbox)"
# What a relay starting now would pick changes only when a DBA changes the server (wal_level
# takes a restart): a watch asks again this often, not at every redraw, which would open a
# connection to every database each time.
WAKEUP_EVERY = 60.0


def add_parser(commands: Any) -> None:
    """Register ``router status``."""
    status_ = commands.add_parser("status", help="backlog, failures and circuits per target")
    status_.add_argument("--database", help="only this database")
    status_.add_argument("--json", action="store_true", help="machine-readable output")
    status_.set_defaults(run=status)
    status_.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        metavar="SECONDS",
        help="redraw every SECONDS (default 2) until interrupted",
    )


async def status(config: RouterConfig, args: argparse.Namespace, redactor: Redactor) -> int:
    if args.watch is None:
        print(await _render(config, args, redactor))
        return EXIT_OK
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    terminal = sys.stdout.isatty()
    wakeups = Probed(lambda: _probe(config, args), WAKEUP_EVERY)
    while not stop.is_set():
        shown = await _render(config, args, redactor, wakeups)
        # A terminal is redrawn in place; a pipe or a file gets one frame after another,
        # each under the time it was read.
        if terminal:
            print(CLEAR + shown, flush=True)
        else:
            print(f"# {datetime.now(UTC).isoformat(timespec='seconds')}\n{shown}\n", flush=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.1, args.watch))
    return EXIT_OK


class Probed:
    """The wake-up reports of ``probe``, asked again once ``every`` seconds have passed since
    the last answer (``clock``: seconds, monotonic)."""

    def __init__(
        self,
        probe: Callable[[], Awaitable[list[Any]]],
        every: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._probe = probe
        self._every = every
        self._clock = clock
        self._reports: list[Any] | None = None
        self._at = 0.0

    async def reports(self) -> list[Any]:
        """The last answer, or a new one when it is older than ``every``."""
        if self._reports is None or self._clock() - self._at >= self._every:
            self._reports = await self._probe()
            self._at = self._clock()
        return self._reports


async def _probe(config: RouterConfig, args: argparse.Namespace) -> list[Any]:
    from router.ops.wakeup import probe_all

    # Another process: it cannot see a running relay's wake-up, only what a probe finds.
    return await probe_all(config, args.database)


async def _render(
    config: RouterConfig,
    args: argparse.Namespace,
    redactor: Redactor,
    probed: Probed | None = None,
) -> str:
    from router.ops.status import status

    rows = await status(config, args.database)
    wakeups = await (probed.reports() if probed is not None else _probe(config, args))
    if args.json:
        document = {
            "targets": [r.as_dict() for r in rows],
            "wakeups": [w.as_dict() for w in wakeups],
        }
        return redactor(json.dumps(document, indent=2, default=str))
    return redactor(_human(rows) + "\n\n" + _wakeups(wakeups))


def _wakeups(reports: list[Any]) -> str:
    lines = [f"  {r.database}: {r.text}" for r in reports]
    return "\n".join([f"wake-up, {PROBED}:", *lines])


def _human(rows: list[Any]) -> str:
    backlog = table(
        [
            "database",
            "target",
            "pending",
            "in flight",
            "retrying",
            "abandoned",
            "published",
            "oldest due",
            "retries/min",
            "circuit",
            "paused",
        ],
        [
            (
                r.database,
                r.target,
                r.pending,
                r.in_flight,
                r.failed,
                r.abandoned,
                r.published,
                _age(r.oldest_claimable_age),
                r.retries_per_minute,
                r.circuit,
                "yes" if r.paused else "no",
            )
            for r in rows
        ],
        right=2,
    )
    flow = table(
        ["last minute", "staged/s", "published/s", "empty in", "within slo", "limits"],
        [
            (
                f"{r.database}/{r.target}",
                f"{r.staged_per_second:.1f}",
                f"{r.published_per_second:.1f}",
                _age(r.time_to_empty_seconds) if r.time_to_empty_seconds is not None else "never",
                _share(r.delivered_within_slo, r.slo_seconds),
                _limits(r),
            )
            for r in rows
        ],
        right=1,
    )
    human = backlog + "\n\n" + flow
    stopped = [_stopped(r) for r in rows if r.held_keys or r.parked_keys]
    if stopped:
        human += (
            "\n\nkeys stopped behind a head refused for good "
            "(`router held` lists them, `router release` frees them):\n" + "\n".join(stopped)
        )
    errors = [f"  {r.database}/{r.target}: {r.last_error}" for r in rows if r.last_error]
    if errors:
        human += "\n\nlatest errors:\n" + "\n".join(errors)
    return human


def _stopped(row: Any) -> str:
    parts = []
    if row.held_keys:
        parts.append(f"{row.held_keys} held {_plural(row.held_keys, 'key')}")
    if row.parked_keys:
        parts.append(
            f"{row.parked_keys} parked {_plural(row.parked_keys, 'key')} "
            f"({row.parked} {_plural(row.parked, 'row')})"
        )
    since = _age(row.oldest_held_age)
    return f"  {row.database}/{row.target}: {', '.join(parts)}; the oldest waits since {since}"


def _plural(count: int, word: str) -> str:
    return word if count == 1 else word + "s"


def _share(share: float | None, slo: float) -> str:
    return "-" if share is None else f"{100 * share:.1f}% <= {slo:g}s"


def _limits(row: Any) -> str:
    parts = []
    if row.rate_limit:
        limit = row.rate_limit
        parts.append(f"rate {limit['messages_per_second']:g}/s burst {limit['burst']}")
    if row.on_backlog:
        parts.append(f"backlog > {row.on_backlog['max_rows']}: {row.on_backlog['action']}")
    return ", ".join(parts) or "-"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"
