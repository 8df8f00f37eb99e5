"""What the tests of the web app examples (examples/flask_shop, examples/fastapi_shop) share:
the environment their README sets, on a fresh database and a stream of the test's own; the
commands their docs page and README document; and what arrived at NATS."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import NATS_URL, NatsStreams, PgDatabases, pg_fetch
from tests.e2e.helpers import ROOT
from tests.services import free_port


async def example_env(
    example: str, pg_databases: PgDatabases, nats_streams: NatsStreams, mp: pytest.MonkeyPatch
) -> dict[str, str]:
    """The variables the example's README exports, set in this process too (the app under
    test reads them): a fresh database ``router init-db`` has not migrated yet, a stream and
    subject no other test uses, and a free port for the router's HTTP console."""
    stream, subject = nats_streams.stream(example.replace("_", ""))
    env = {
        "ROUTER_CONFIG": str(ROOT / "examples" / example / "config.yaml"),
        "DATABASE_URL": await pg_databases.new(migrated=False),
        "NATS_URL": NATS_URL,
        "NATS_STREAM": stream,
        "NATS_SUBJECT": subject,
        "ROUTER_HTTP_BIND": f"127.0.0.1:{free_port()}",
    }
    for name, value in env.items():
        mp.setenv(name, value)
    return env


@dataclass(frozen=True)
class Delivered:
    """One message of the stream: its subject, ``Nats-Msg-Id`` and internal envelope."""

    subject: str
    msg_id: str
    body: dict[str, Any]

    @property
    def event(self) -> tuple[str, str]:
        """(event type, order id)."""
        return self.body["type"], self.body["payload"]["order_id"]


def delivered(
    nats_streams: NatsStreams, env: dict[str, str], expected: int, timeout: float = 15
) -> list[Delivered]:
    """The stream's messages in order, once it holds ``expected`` (or after ``timeout``)."""
    found = asyncio.run(nats_streams.messages(env["NATS_STREAM"], expected, timeout))
    return [
        Delivered(m.subject, (m.headers or {}).get("Nats-Msg-Id", ""), json.loads(m.data))
        for m in found
    ]


def query(env: dict[str, str], sql: str) -> list[tuple[Any, ...]]:
    """The rows of one query on the example's database."""
    return [tuple(r) for r in asyncio.run(pg_fetch(env["DATABASE_URL"], sql))]


def check_envelopes(messages: list[Delivered], env: dict[str, str], service: str) -> None:
    """Each message is on ``<subject>.<type>``, deduplicated by its event id, from
    ``service``, on the stream of its order (the internal envelope's ``stream``)."""
    for message in messages:
        body = message.body
        assert message.subject == f"{env['NATS_SUBJECT']}.{body['type']}", message
        assert message.msg_id == body["id"], message
        assert body["source"] == service, body
        assert body["stream"] == body["payload"]["order_id"], body


def in_order_per_order(messages: list[Delivered], order_id: str) -> list[str]:
    """The event types delivered for one order, in stream order."""
    return [m.body["type"] for m in messages if m.event[1] == order_id]


@dataclass(frozen=True)
class Commands:
    """The ```bash block of an example's docs page and README."""

    text: str
    exported: frozenset[str]  # the variables it exports
    lines: list[str]  # the commands after the exports, comments stripped


def documented_commands(page: Path) -> Commands:
    """The first ```bash block of ``page``."""
    found = re.search(r"^```bash\n(.*?)^```", page.read_text(encoding="utf-8"), re.M | re.S)
    assert found, f"{page} has no ```bash block"
    exported: set[str] = set()
    lines = []
    for line in found[1].splitlines():
        command = line.partition("#")[0].strip()
        if command.startswith("export "):
            exported.add(command.removeprefix("export ").partition("=")[0])
        elif command:
            lines.append(command)
    return Commands(found[1].strip(), frozenset(exported), lines)


def run_documented(line: str) -> subprocess.CompletedProcess[str]:
    """One documented command, as a user types it in examples/, with this venv's commands
    (``router``, ``flask``, ``uvicorn``) first on the PATH and this process's environment."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return subprocess.run(
        ["bash", "-c", line],
        cwd=ROOT / "examples",
        env={**os.environ, "PATH": path},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def lines_not_in(page: Path, source: Path) -> list[str]:
    """The lines of ``page``'s ```python excerpts that ``source`` does not have (blank lines
    and ``...`` aside): the docs show the example's code, only shortened."""
    have = {line.strip() for line in source.read_text(encoding="utf-8").splitlines()}
    text = page.read_text(encoding="utf-8")
    return [
        line.strip()
        for block in re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)
        for line in block.splitlines()
        if line.strip() not in ("", "...") and line.strip() not in have
    ]
