"""A gray partition between one host and a broker (or its database), under load.

Two ``router serve --workers 2`` share one PostgreSQL database and one broker, standing for
two hosts. Every connection of both goes through one ``GrayProxy``; after a warm-up the proxy
cuts host A off (its connections stay open and pass nothing), later it heals. Meanwhile the
test commits events at a steady rate over many stream keys. Afterwards it reads the broker
back and reports:

- lost events (committed, never arrived) and per-stream order violations (a first delivery
  of a stream's n-th event after one of a later event);
- repeats (an event stored more than once), which at-least-once delivery allows;
- commit-to-delivery time per event (the row's ``created_at`` to its ``published_at``): p50,
  p99, max; and the longest stretch with events waiting and none delivered;
- how soon after the heal host A delivered again (its ``circuit.closed``).

    PARTITION_SECONDS=30 PARTITION_RATE=400 PARTITION_STREAMS=200 \
        python -m pytest tests/contract/test_partition.py -s

runs a larger one than the suite does (8 s, 200 events/s, 100 keys), printing the figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import statistics
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import asyncpg
import yaml

from router import Outbox
from tests.chaos.proxy import GrayProxy
from tests.conftest import make_config
from tests.contract.harnesses import Harness
from tests.e2e.helpers import Serving
from tests.e2e.test_worker_recovery import both_ready
from tests.integration.events import OrderPlaced

HOSTS = ("host-a", "host-b")
POOL_ENV = {"ROUTER_WORKERS": "2", "ROUTER_LOG_FORMAT": "json", "ROUTER_LOG_LEVEL": "info"}
EVENT_TYPE = "order_placed"


@dataclass
class Plan:
    """One run's size."""

    path: str = "broker"  # what host A is cut off from: "broker" or "database"
    seconds: float = 8.0  # how long host A is cut off
    rate: float = 200.0  # events committed per second
    streams: int = 100
    warm_up: float = 3.0
    after: float = 6.0  # producing on after the heal
    lease_seconds: float = 10.0
    stall: float = 0.3  # the shortest stretch counted in Outcome.stalls (seconds)


@dataclass
class Outcome:
    """What one run measured (``table()`` prints it)."""

    broker: str
    plan: Plan
    committed: int = 0
    delivered: int = 0
    lost: int = 0
    repeats: int = 0
    order_violations: int = 0
    p50: float = 0.0
    p99: float = 0.0
    max: float = 0.0
    p99_during: float = 0.0  # of events committed while host A was cut off
    longest_stall: float = 0.0
    # Stretches longer than ``plan.stall`` with events waiting and none delivered, from a
    # second before the cut to a second after the heal: a cut-off worker that holds a batch
    # makes one (two workers finding the cut one after the other make one twice as long).
    stalls: list[float] = field(default_factory=list)
    # Host A's publishes that found the path cut (its ``broker.unavailable`` records while cut
    # off): one worker's, when its siblings learn of the cut from it.
    found_cut: int = 0
    rejoined_after: float | None = None  # heal -> host A's first answered publish (s)
    cut_off_logged_after: float | None = None  # cut -> host A's circuit.opened (s)
    by_host: dict[str, int] = field(default_factory=dict)
    abandoned: int = 0

    def table(self) -> str:
        """One line per figure."""
        rejoin = "-" if self.rejoined_after is None else f"{self.rejoined_after:.2f} s"
        noticed = "-" if self.cut_off_logged_after is None else f"{self.cut_off_logged_after:.2f} s"
        rows = [
            ("broker / path cut", f"{self.broker} / {self.plan.path}"),
            ("cut off", f"{self.plan.seconds:g} s, {self.plan.rate:g}/s, {self.plan.streams} keys"),
            ("committed / delivered", f"{self.committed} / {self.delivered}"),
            ("lost / order violations", f"{self.lost} / {self.order_violations}"),
            ("repeats", str(self.repeats)),
            ("commit->delivery p50/p99/max", f"{self.p50:.3f} / {self.p99:.3f} / {self.max:.3f} s"),
            ("p99 of events committed while cut", f"{self.p99_during:.3f} s"),
            ("longest stall", f"{self.longest_stall:.3f} s"),
            (
                f"stalls > {self.plan.stall:g} s while cut",
                ", ".join(f"{s:.2f} s" for s in self.stalls) or "none",
            ),
            ("host A's publishes that found the cut", str(self.found_cut)),
            ("host A noticed the cut", noticed),
            ("host A rejoined after the heal", rejoin),
            ("published by host", json.dumps(self.by_host)),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)

    def to_json(self) -> dict[str, Any]:
        """The figures as JSON."""
        return asdict(self)


def via_proxy(harness: Harness, port: int) -> dict[str, Any]:
    """The harness's broker as config.yaml names it, reached at 127.0.0.1:``port``."""
    data = harness.config(connect_timeout=2.0, publish_timeout=5.0)
    kind = harness.kind
    if kind == "kafka":
        data["bootstrap_servers"] = f"127.0.0.1:{port}"
    elif kind == "servicebus":
        head, _, rest = data["connection_string"].partition("Endpoint=sb://localhost:")
        data["connection_string"] = (
            head + "Endpoint=sb://localhost:" + str(port) + rest[rest.index(";") :]
        )
    else:
        scheme, _, rest = data["url"].partition("://")
        credentials = rest.rsplit("@", 1)[0] + "@" if "@" in rest else ""
        path = rest.split("/", 1)[1] if "/" in rest.rsplit("@", 1)[-1] else ""
        data["url"] = f"{scheme}://{credentials}127.0.0.1:{port}" + (f"/{path}" if path else "")
    return {**data, "internal": True}


def upstream_of(harness: Harness) -> tuple[str, int]:
    """Where the harness's broker listens."""
    data = harness.config()
    kind = harness.kind
    if kind == "kafka":
        address = data["bootstrap_servers"]
    elif kind == "servicebus":
        address = data["connection_string"].split("Endpoint=sb://", 1)[1].split(";", 1)[0]
    else:
        address = data["url"].partition("://")[2].rsplit("@", 1)[-1].split("/", 1)[0]
    host, _, port = address.partition(":")
    return ("127.0.0.1" if host == "localhost" else host), int(port)


class PartitionRun:
    """One run: two hosts, one cut off for ``plan.seconds``."""

    def __init__(
        self, harness: Harness, proxy: GrayProxy, db_url: str, folder: Path, plan: Plan
    ) -> None:
        self.harness = harness
        self.proxy = proxy
        self.db_url = db_url
        self.folder = folder
        self.plan = plan
        self.outcome = Outcome(harness.kind, plan)
        self.destination = harness.destination(EVENT_TYPE)
        self.cut_at = self.healed_at = 0.0
        self.db_proxy: GrayProxy | None = None

    async def run(self) -> Outcome:
        """Start the hosts, produce, cut, heal, drain, read back, stop."""
        await self.harness.prepare(self.destination)
        brokers = {"events": via_proxy(self.harness, self.proxy.port)}
        db_url = self.db_url
        if self.plan.path == "database":
            host, port = _pg_address(self.db_url)
            self.db_proxy = GrayProxy(host, port)
            await self.db_proxy.start()
            db_url = _pg_with_port(self.db_url, self.db_proxy.port)
        hosts = {name: self._start_host(name, db_url, brokers) for name in HOSTS}
        try:
            for serving in hosts.values():
                await both_ready(serving, timeout=60)
            await self._produce_and_cut(hosts["host-a"], brokers)
            await self._until_published(hosts, timeout=max(60.0, self.plan.seconds * 3))
        finally:
            for serving in hosts.values():
                await asyncio.to_thread(serving.stop, signal.SIGTERM)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(serving.process.pid, signal.SIGKILL)
            if self.db_proxy is not None:
                await self.db_proxy.stop()
        await self._measure(hosts)
        return self.outcome

    def _start_host(self, name: str, db_url: str, brokers: dict[str, Any]) -> Serving:
        folder = self.folder / name
        folder.mkdir(parents=True)
        config = {
            "service": "shop",
            "databases": {"main": db_url},
            "brokers": brokers,
            "http": {"enabled": False},
            "outbox": {"lease_seconds": self.plan.lease_seconds},
        }
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
        return Serving(folder, {**POOL_ENV, "ROUTER_INSTANCE": name}, new_session=True)

    async def _produce_and_cut(self, host_a: Serving, brokers: dict[str, Any]) -> None:
        """Commit events at ``plan.rate``, one per transaction; cut host A off after the
        warm-up and heal it ``plan.seconds`` later."""
        plan = self.plan
        outbox = Outbox(make_config({"main": self.db_url}, brokers))
        loop = asyncio.get_running_loop()
        started = loop.time()
        total = int(plan.rate * (plan.warm_up + plan.seconds + plan.after))
        session = os.getsid(host_a.process.pid)
        proxy = self.db_proxy if self.db_proxy is not None else self.proxy
        try:
            for i in range(total):
                due = started + i / plan.rate
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                since = loop.time() - started
                if not self.cut_at and since >= plan.warm_up:
                    proxy.cut(session)
                    self.cut_at = time.time()
                if self.cut_at and not self.healed_at and since >= plan.warm_up + plan.seconds:
                    proxy.heal()
                    self.healed_at = time.time()
                async with outbox.transaction() as tx:
                    await tx.stage(
                        OrderPlaced(order_id=f"o-{i}", total=Decimal(i)),
                        stream_key=f"s{i % plan.streams}",
                    )
        finally:
            proxy.heal()
            if not self.healed_at:
                self.healed_at = time.time()
            await outbox.close()
        self.outcome.committed = total

    async def _until_published(self, hosts: dict[str, Serving], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        conn = await asyncpg.connect(self.db_url)
        try:
            query = (
                "SELECT count(*) FROM router_outbox WHERE status NOT IN ('published', 'abandoned')"
            )
            while left := await conn.fetchval(query):
                for name, serving in hosts.items():
                    assert serving.process.poll() is None, f"{name}: {serving.log.read_text()}"
                assert time.monotonic() < deadline, f"{left} rows not published in {timeout:.0f} s"
                await asyncio.sleep(0.2)
        finally:
            await conn.close()

    async def _measure(self, hosts: dict[str, Serving]) -> None:
        out = self.outcome
        conn = await asyncpg.connect(self.db_url)
        try:
            rows = await conn.fetch(
                "SELECT extract(epoch FROM created_at)::float8 AS created,"
                " extract(epoch FROM published_at)::float8 AS published, status"
                " FROM router_outbox ORDER BY seq"
            )
        finally:
            await conn.close()
        out.abandoned = sum(1 for r in rows if r["status"] == "abandoned")
        done = [(r["created"], r["published"]) for r in rows if r["published"] is not None]
        delays = sorted(p - c for c, p in done)
        if delays:
            out.p50 = statistics.median(delays)
            out.p99 = delays[min(len(delays) - 1, int(len(delays) * 0.99))]
            out.max = delays[-1]
        during = sorted(p - c for c, p in done if self.cut_at <= c <= self.healed_at)
        if during:
            out.p99_during = during[min(len(during) - 1, int(len(during) * 0.99))]
        out.longest_stall = longest_stall(done)
        out.stalls = [
            length
            for start, length in stretches(done)
            # From a second before the cut: the batch in flight at the cut began before it.
            if length > self.plan.stall and self.cut_at - 1.0 <= start <= self.healed_at + 1.0
        ]
        out.found_cut = sum(
            1
            for t in _log_times(hosts["host-a"], "broker.unavailable")
            if self.cut_at <= t <= self.healed_at
        )
        for name, serving in hosts.items():
            out.by_host[name] = sum(
                int(record.get("published", 0))
                for record in _log_records(serving, "processor.stopped")
            )
        numbers = await self._arrived_numbers(out.committed)
        first = list(dict.fromkeys(numbers))
        out.delivered = len(first)
        out.repeats = len(numbers) - len(first)
        out.lost = len(set(range(out.committed)) - set(first))
        out.order_violations = order_violations(first, self.plan.streams)
        a = hosts["host-a"]
        opened = [t for t in _log_times(a, "circuit.opened") if t >= self.cut_at]
        if opened:
            out.cut_off_logged_after = opened[0] - self.cut_at
        closed = [t for t in _log_times(a, "circuit.closed") if t >= self.healed_at]
        if closed:
            out.rejoined_after = closed[0] - self.healed_at

    async def _arrived_numbers(self, count: int) -> list[int]:
        """The event numbers stored at the destination, in order, repeats included: read
        until every one of the ``count`` events is there, or nothing more comes."""
        arrived = await self.harness.arrived(self.destination, count, timeout=30)
        while True:
            numbers = [int(json.loads(m.body)["payload"]["order_id"][2:]) for m in arrived]
            missing = count - len(set(numbers))
            if missing <= 0:
                return numbers
            more = await self.harness.arrived(self.destination, len(arrived) + missing, timeout=5)
            if len(more) == len(arrived):
                return numbers
            arrived = more


def longest_stall(done: list[tuple[float, float]]) -> float:
    """The longest of ``stretches``."""
    return max((length for _, length in stretches(done)), default=0.0)


def stretches(done: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(start, seconds) of every stretch in which some event waited (committed, not yet
    delivered) and none was delivered: between two consecutive deliveries, from the later of
    the first one and the earliest commit among the events delivered after it."""
    by_delivery = sorted(done, key=lambda cp: cp[1])
    found = []
    earliest_after = float("inf")
    for index in range(len(by_delivery) - 1, 0, -1):
        earliest_after = min(earliest_after, by_delivery[index][0])
        previous = by_delivery[index - 1][1]
        waited_from = max(previous, earliest_after)
        found.append((waited_from, by_delivery[index][1] - waited_from))
    return found[::-1]


def order_violations(first_deliveries: list[int], streams: int) -> int:
    """First deliveries of an event after a later event of its stream (event n is on stream
    n % streams, and each stream's events were committed in increasing n)."""
    latest: dict[int, int] = {}
    violations = 0
    for n in first_deliveries:
        key = n % streams
        if latest.get(key, -1) > n:
            violations += 1
        latest[key] = max(latest.get(key, -1), n)
    return violations


def _log_records(serving: Serving, event: str) -> list[dict[str, Any]]:
    records = []
    for line in serving.log.read_text().splitlines():
        if line.startswith("{") and f'"{event}"' in line:
            record = json.loads(line)
            if record.get("event") == event:
                records.append(record)
    return records


def _log_times(serving: Serving, event: str) -> list[float]:
    return [datetime.fromisoformat(r["time"]).timestamp() for r in _log_records(serving, event)]


def _pg_address(url: str) -> tuple[str, int]:
    rest = url.partition("://")[2].rsplit("@", 1)[-1].split("/", 1)[0]
    host, _, port = rest.partition(":")
    return host or "127.0.0.1", int(port or 5432)


def _pg_with_port(url: str, port: int) -> str:
    scheme, _, rest = url.partition("://")
    credentials, _, location = rest.rpartition("@")
    database = location.split("/", 1)[1]
    prefix = f"{credentials}@" if credentials else ""
    return f"{scheme}://{prefix}127.0.0.1:{port}/{database}"
