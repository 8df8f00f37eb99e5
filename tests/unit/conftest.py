"""Helpers shared by the unit tests: a real, migrated SQLite outbox and ways to read it back."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import orjson
import pytest

from brokers import MemoryBroker, OutgoingMessage, PublishResult
from router import Event, Outbox, Processor, RouterConfig
from router.config import DatabaseSettings
from router.ops.migrate import upgrade
from router.relay.store.sqlite import SqliteStore
from tests.conftest import make_config

DATABASE_URL = "sqlite:///outbox.db"

# Short timeouts so a hanging broker costs a test about a second, not fifteen.
EVENTS_BROKER: dict[str, Any] = {
    "type": "memory",
    "internal": True,
    "connect_timeout": 0.2,
    "publish_timeout": 0.2,
}
RETRY: dict[str, Any] = {"base_delay": 1.0, "max_delay": 10, "jitter": 0.2, "max_attempts": 3}


class Numbered(Event, type="numbered", published=True):
    """A test event that says which one it is."""

    n: int


Handler = Callable[[OutgoingMessage], PublishResult | None]


def number_of(message: OutgoingMessage) -> int:
    """The ``n`` of a message rendered from a ``Numbered`` event (internal profile)."""
    n: int = orjson.loads(message.wire.body)["payload"]["n"]
    return n


def numbers(broker: MemoryBroker) -> list[int]:
    """The ``n`` of every message the broker acknowledged, in order."""
    return [number_of(m) for m in broker.messages]


def refusing(*refused: int, retryable: bool = True, times: int | None = None) -> Handler:
    """A broker handler that refuses the events numbered ``refused`` (the first ``times``)."""
    seen: dict[int, int] = {}

    def handler(message: OutgoingMessage) -> PublishResult | None:
        n = number_of(message)
        if n not in refused:
            return None
        seen[n] = seen.get(n, 0) + 1
        if times is not None and seen[n] > times:
            return None
        return PublishResult.failed(f"refused {n}", retryable=retryable)

    return handler


def read_time(stamp: str) -> datetime:
    """A time as the SQLite outbox stores it (UTC text, microseconds)."""
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=UTC)


def table_rows(path: Path) -> list[dict[str, Any]]:
    """Every row of ``router_outbox`` in the SQLite file, in seq order (stdlib sqlite3)."""
    with sqlite3.connect(path) as db:
        db.row_factory = sqlite3.Row
        return [dict(r) for r in db.execute("SELECT * FROM router_outbox ORDER BY seq")]


async def migrate(folder: Path, url: str = DATABASE_URL) -> None:
    """Create the router's tables in a SQLite file in ``folder``."""
    await upgrade("main", DatabaseSettings.model_validate({"url": url}), folder)


class OutboxFile:
    """A migrated SQLite outbox, an Outbox staging into it, and processors over memory brokers."""

    def __init__(self, folder: Path, config: RouterConfig) -> None:
        self.folder = folder
        self.path = folder / "outbox.db"
        self.config = config
        self.outbox = Outbox(config)
        self.store = SqliteStore("main", self.path)
        self.brokers = {name: MemoryBroker(name) for name in config.brokers}

    @property
    def broker(self) -> MemoryBroker:
        """The internal broker ``events``."""
        return self.brokers["events"]

    def processor(
        self, *, target: str = "events", worker: str = "w1", rand: float = 0.5
    ) -> Processor:
        """A processor of ``target``, with jitter fixed by ``rand`` (0: shortest, 1: longest)."""
        return Processor(
            database="main",
            target=target,
            settings=self.config.brokers[target],
            broker=self.brokers[target],
            store=self.store,
            outbox=self.config.outbox,
            worker_id=worker,
            rand=lambda: rand,
        )

    async def stage(self, *ns: int, stream_key: str | None = None) -> list[str]:
        """Stage ``Numbered`` events in one committed transaction; returns their ids."""
        async with self.outbox.transaction() as tx:
            return await tx.stage(*(Numbered(n=n) for n in ns), stream_key=stream_key)

    def rows(self, target: str | None = None) -> list[dict[str, Any]]:
        """The table's rows (of one target, if given), in seq order."""
        return [r for r in table_rows(self.path) if target is None or r["target"] == target]

    def statuses(self, target: str | None = None) -> list[str]:
        """The status of each row, in seq order."""
        return [r["status"] for r in self.rows(target)]

    async def close(self) -> None:
        """Dispose the engine and the store's connection."""
        await self.outbox.close()
        await self.store.close()


class OpenOutbox(Protocol):
    """Makes a fresh ``OutboxFile``; keyword arguments are ``outbox:`` settings."""

    async def __call__(
        self, *, brokers: dict[str, Any] | None = None, **outbox: Any
    ) -> OutboxFile: ...


@pytest.fixture
async def open_outbox(tmp_path: Path) -> AsyncIterator[OpenOutbox]:
    """Open as many outbox files as a test needs (each in its own folder); closed after."""
    opened: list[OutboxFile] = []

    async def open_(*, brokers: dict[str, Any] | None = None, **outbox: Any) -> OutboxFile:
        folder = tmp_path / f"outbox{len(opened)}"
        folder.mkdir()
        await migrate(folder)
        config = make_config(
            {"main": DATABASE_URL},
            brokers or {"events": EVENTS_BROKER},
            base_dir=folder,
            outbox={"retry": RETRY, **outbox},
        )
        opened.append(OutboxFile(folder, config))
        return opened[-1]

    yield open_
    for outbox_file in opened:
        await outbox_file.close()


@pytest.fixture
async def outbox_file(open_outbox: OpenOutbox) -> OutboxFile:
    """One outbox file with the default settings: broker ``events``, retry ``RETRY``."""
    return await open_outbox()
