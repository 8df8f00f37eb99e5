"""Load shedding for a runaway backlog: a target's ``on_backlog`` rule, checked every few
seconds by the process that also runs the cleanup (a single router, or a pool's parent).

A target's queue (rows pending or waiting to retry) is counted up to ``max_rows + 1`` through
the claim index, so a check costs at most that many index entries however long the backlog.
Past ``max_rows``:

- ``alert``: one warning in the log when the queue crosses the line (and one when it is back
  under); ``router_backlog_over_limit`` is 1 meanwhile (read from the backlog at each scrape).
- ``pause``: the target is paused as ``router pause`` pauses it, with an audit row naming the
  rule. Once paused by the rule it is not paused again until its queue has been back under
  ``max_rows``, so an operator who resumes it to drain the backlog is not overruled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from brokers import OnBacklog
from envelopes import RouterError
from router.config import RouterConfig
from router.ops.schema import outbox

__all__ = ["BACKLOG_CHECK_SECONDS", "BacklogWatch", "queued"]

log = logging.getLogger(__name__)

BACKLOG_CHECK_SECONDS = 5.0
ACTOR = "router (on_backlog)"


async def queued(engine: AsyncEngine, target: str, cap: int) -> int:
    """The target's queued rows (pending or waiting to retry), counted up to ``cap``."""
    o = outbox
    some = (
        sa.select(sa.literal(1))
        .where(o.c.target == target, o.c.status.in_(("pending", "failed")))
        .limit(cap)
        .subquery()
    )
    async with engine.connect() as conn:
        return int((await conn.execute(sa.select(sa.func.count()).select_from(some))).scalar_one())


class BacklogWatch:
    """Applies every target's ``on_backlog`` rule; ``run()`` until cancelled."""

    def __init__(self, config: RouterConfig, interval: float = BACKLOG_CHECK_SECONDS) -> None:
        self.config = config
        self.interval = interval
        self.rules = {
            (database, target): settings.on_backlog
            for database in config.databases
            for target, settings in config.brokers_of(database).items()
            if settings.on_backlog is not None
        }
        self.over: set[tuple[str, str]] = set()  # over the line at the last check
        self.shed: set[tuple[str, str]] = set()  # paused by the rule, not yet back under

    async def run(self) -> None:
        """Check every ``interval`` seconds; a failed check is logged and tried again."""
        if not self.rules:
            return
        async with self._engines() as engines:
            while True:
                for (database, target), rule in self.rules.items():
                    try:
                        await self.check(engines[database], database, target, rule)
                    except (RouterError, sa.exc.SQLAlchemyError, OSError) as exc:
                        log.warning(
                            "backlog.check_failed",
                            extra={"database": database, "target": target, "error": str(exc)},
                        )
                await asyncio.sleep(self.interval)

    async def check(self, engine: AsyncEngine, database: str, target: str, rule: OnBacklog) -> None:
        """One check of one target."""
        key = (database, target)
        count = await queued(engine, target, rule.max_rows + 1)
        labels = {"database": database, "target": target, "max_rows": rule.max_rows}
        if count <= rule.max_rows:
            if key in self.over:
                log.info("backlog.under_limit", extra=labels)
            self.over.discard(key)
            self.shed.discard(key)
            return
        if key not in self.over:
            log.warning("backlog.over_limit", extra={**labels, "action": rule.action})
            self.over.add(key)
        if rule.action == "pause" and key not in self.shed:
            from router.ops.outbox import set_paused

            await set_paused(
                self.config,
                target,
                paused=True,
                database=database,
                by=ACTOR,
                actor=ACTOR,
            )
            self.shed.add(key)
            log.warning("backlog.paused", extra=labels)

    @contextlib.asynccontextmanager
    async def _engines(self) -> AsyncIterator[dict[str, AsyncEngine]]:
        from router._db import create_engine

        needed = {database for database, _ in self.rules}
        engines = {
            name: create_engine(
                self.config.databases[name], self.config.base_dir, name=name, pool_pre_ping=False
            )
            for name in needed
        }
        try:
            yield engines
        finally:
            for engine in engines.values():
                await engine.dispose()
