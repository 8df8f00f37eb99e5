"""A relay to time wake-ups with: ``router serve``'s runner on one database, its safety poll
(``poll_interval``) an hour away, so only the database's wake-up can bring a row in time; a
memory broker that notes when each message arrived; and writers in a process of their own
(tests/integration/stager_process.py), so no in-process signal of the router's helps."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from brokers import Broker, BrokerSettings, MemoryBroker, OutgoingMessage, PublishResult
from router import Runner
from router.relay.store.base import OutboxStore
from tests.conftest import make_config

__all__ = ["ONE_TARGET", "Relay", "SlowBroker"]

ROOT = Path(__file__).resolve().parents[2]
ONE_TARGET = {"events": {"type": "memory", "internal": True}}


class SlowBroker(MemoryBroker):
    """A memory broker that takes ``delay`` seconds over each batch."""

    def __init__(self, name: str, *, handler: Any, delay: float) -> None:
        super().__init__(name, handler=handler)
        self.delay = delay

    async def publish(self, batch: Sequence[OutgoingMessage]) -> list[PublishResult]:
        """Wait ``delay``, then keep the batch."""
        await asyncio.sleep(self.delay)
        return await super().publish(batch)


class Relay:
    """The runner on ``url`` (``config.json`` in ``base_dir``, which the writers read too);
    ``broker``: settings of its one broker, ``events``, beyond the defaults; ``linger``: its
    ``outbox.linger``."""

    def __init__(
        self,
        url: str,
        base_dir: Path,
        *,
        wakeup: str = "auto",
        batch_size: int = 500,
        publish_delay: float = 0.0,
        broker: dict[str, Any] | None = None,
        linger: float = 0.0,
    ) -> None:
        database = {"url": url, "wakeup": wakeup}
        outbox = {"poll_interval": 3600, "batch_size": batch_size, "linger": linger}
        brokers = {"events": {**ONE_TARGET["events"], **(broker or {})}}
        self.config = make_config({"main": database}, brokers, base_dir=base_dir, outbox=outbox)
        self.publish_delay = publish_delay
        self.config_file = base_dir / "config.json"
        self.config_file.write_text(
            json.dumps({"databases": {"main": database}, "brokers": brokers})
        )
        self.arrived: dict[str, float] = {}
        self.runner = Runner(
            self.config,
            broker_factory=self._broker,
            start_embedded=False,
            serve_http=False,
            run_cleanup=False,
        )

    @property
    def store(self) -> OutboxStore:
        """The database's store, whose ``wakeup`` says how it wakes."""
        return self.runner.stores["main"]

    async def settled(self, timeout: float = 10.0) -> str:
        """The wake-up mechanism the store settled on, once it chose."""
        deadline = time.monotonic() + timeout
        while self.store.wakeup.mechanism == "starting" and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return self.store.wakeup.mechanism

    def _broker(self, name: str, settings: BrokerSettings) -> Broker:
        return SlowBroker(name, handler=self._note, delay=self.publish_delay)

    def _note(self, message: OutgoingMessage) -> PublishResult | None:
        self.arrived.setdefault(message.wire.message_id, time.time())
        return None

    async def stage_elsewhere(self, plan: list[list[float]]) -> dict[str, float]:
        """Run ``plan`` (per writer thread, the seconds before each of its events) in a writer
        process of its own; each message id's commit time."""
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.integration.stager_process",
            str(self.config_file),
            json.dumps({"threads": plan}),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        out, err = await process.communicate()
        assert process.returncode == 0, err.decode()
        lines = [json.loads(line) for line in out.decode().splitlines()]
        return {line["id"]: line["committed"] for line in lines}

    async def lateness(self, committed: dict[str, float], within: float = 2.0) -> list[float]:
        """Seconds from each commit to its arrival, once every one arrived."""
        deadline = time.monotonic() + within
        while not committed.keys() <= self.arrived.keys() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        missing = committed.keys() - self.arrived.keys()
        assert not missing, f"{len(missing)} of {len(committed)} never arrived"
        return [self.arrived[m] - committed[m] for m in committed]
