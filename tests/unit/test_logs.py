"""Every line the router writes to stderr is in its log format and redacted, the client
libraries' lines too: asked for JSON, a log shipper gets nothing but JSON objects."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from router import Event, Outbox
from tests.services import free_port

PASSWORDS = ("Rabbit-S3cret", "Redis-S3cret", "Kafka-S3cret")


class Ping(Event, type="logs.ping", published=True):
    """Something for every broker to fail to receive."""

    n: int


def config(tmp_path: Path) -> Path:
    """A SQLite outbox and three partners, each on a closed port with a password."""
    rabbit, kafka, redis = free_port(), free_port(), free_port()
    text = f"""
        service: shop
        databases:
          main: sqlite:///./outbox.db
        brokers:
          events: {{type: memory, internal: true}}
          rabbit:
            type: rabbitmq
            url: amqp://guest:{PASSWORDS[0]}@127.0.0.1:{rabbit}/
            exchange: {{name: shop.events, type: topic}}
            connect_timeout: 1
            publish_timeout: 1
          cache:
            type: redis
            url: redis://:{PASSWORDS[1]}@127.0.0.1:{redis}/0
            connect_timeout: 1
            publish_timeout: 1
          kafka:
            type: kafka
            bootstrap_servers: 127.0.0.1:{kafka}
            sasl: {{username: shop, password: {PASSWORDS[2]}, mechanism: PLAIN}}
            connect_timeout: 1
            publish_timeout: 1
        http: {{enabled: false}}
    """
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def router(*args: str, cwd: Path, stderr: Any = subprocess.PIPE) -> subprocess.Popen[str]:
    """``python -m router ARGS``."""
    return subprocess.Popen(
        [sys.executable, "-m", "router", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(Path.cwd())},
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        text=True,
    )


def wait_for_failures(log: Path, targets: set[str], timeout: float = 15) -> None:
    """Wait until every target's circuit has opened (its broker is unreachable)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = log.read_text().splitlines()
        if all(
            any(f'"target": "{t}"' in s and "circuit.opened" in s for s in lines) for t in targets
        ):
            return
        time.sleep(0.1)


def records(stderr: str) -> list[dict[str, Any]]:
    """Every stderr line as a JSON object; fails on the first line that is not one."""
    parsed = []
    for line in stderr.splitlines():
        try:
            parsed.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}\n{stderr}") from None
    return parsed


def python(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter, which has imported no broker SDK yet."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, "PYTHONPATH": str(Path.cwd())},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_serve_writes_only_redacted_json_lines_drivers_included(tmp_path: Path) -> None:
    path = config(tmp_path)
    assert router("-c", str(path), "init-db", cwd=tmp_path).wait(30) == 0
    outbox = Outbox.from_file(path)
    async with outbox.transaction() as tx:
        await tx.stage(Ping(n=1))
    await outbox.close()

    log = tmp_path / "stderr.log"
    with log.open("w") as stderr:
        serving = router(
            "-c", str(path), "--log-format", "json", "serve", cwd=tmp_path, stderr=stderr
        )
        try:
            await asyncio.to_thread(wait_for_failures, log, {"rabbit", "cache", "kafka"})
        finally:
            serving.send_signal(signal.SIGTERM)
            returncode = serving.wait(30)
    output = log.read_text()
    assert returncode == 0, output
    for password in PASSWORDS:
        assert password not in output
    logged = records(output)
    # Unreachable: no row failed, each target's circuit opened instead.
    assert not [r for r in logged if r["event"] == "batch.failures"]
    opened = {r["target"] for r in logged if r["event"] == "circuit.opened"}
    assert opened == {"rabbit", "cache", "kafka"}
    errors = {r["error"] for r in logged if r["event"] == "broker.unavailable"}
    assert any(
        e.startswith("cache: cannot connect to Redis: redis://***@127.0.0.1:") for e in errors
    )
    assert any(e.endswith(": connection refused") for e in errors)
    # The drivers' own lines come in the same format: aiormq's and aiokafka's refusals ...
    drivers = [r for r in logged if not r["logger"].startswith("router")]
    assert {"aiormq", "aiokafka"} <= {r["logger"].split(".")[0] for r in drivers}
    assert all({"time", "level", "logger", "event"} <= set(r) for r in drivers)
    # ... but not their info chatter (aio-pika's "Reconnecting after 5 seconds").
    assert [r for r in drivers if r["level"] in ("info", "debug")] == []


def test_faststream_warnings_and_a_crash_come_out_as_redacted_json() -> None:
    # FastStream is imported after the setup (brokers load lazily) and gives its logger a
    # coloured stderr handler of its own; warnings and tracebacks print themselves.
    done = python(
        """
        import logging, warnings
        from router.cli.logs import setup_logging
        from router._secrets import Redactor
        setup_logging("info", "json", Redactor(["pw-1234"]))
        import faststream.redis
        logging.getLogger("faststream").warning("lost amqp://u:pw-1234@h")
        logging.getLogger("faststream").info("faststream chatter")
        logging.getLogger("azure.servicebus").info("azure per-connection chatter")
        logging.getLogger("aiokafka").error("Unable connect to pw-1234")
        warnings.warn("deprecated pw-1234", DeprecationWarning, stacklevel=1)
        raise ConnectionError("redis://:pw-1234@cache")
        """
    )
    assert done.returncode == 1
    assert "pw-1234" not in done.stderr
    logged = records(done.stderr)
    assert [(r["logger"], r["level"]) for r in logged] == [
        ("faststream", "warning"),
        ("aiokafka", "error"),
        ("py.warnings", "warning"),
        ("router", "critical"),
    ]
    assert logged[0]["event"] == "lost amqp://u:***@h"
    assert "DeprecationWarning: deprecated ***" in logged[2]["event"]
    assert logged[3]["event"] == "router.crashed"
    assert "ConnectionError: redis://:***@cache" in logged[3]["exception"]


def test_driver_chatter_is_shown_at_debug_and_sql_never() -> None:
    done = python(
        """
        import json, logging
        from router.cli.logs import setup_logging
        names = ("aiokafka", "aio_pika", "azure", "faststream", "asyncio", "sqlalchemy", "router")
        for level in ("debug", "info", "error"):
            setup_logging(level, "json")
            print(json.dumps({n: logging.getLogger(n).getEffectiveLevel() for n in names}))
        """
    )
    assert done.returncode == 0, done.stderr
    debug, info, error = (json.loads(line) for line in done.stdout.splitlines())
    assert debug == {**dict.fromkeys(debug, 10), "sqlalchemy": 30}
    assert info == {**dict.fromkeys(info, 30), "router": 20}
    assert error == dict.fromkeys(error, 40)
