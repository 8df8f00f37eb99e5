"""``router check`` changes nothing: it reports what serve would create; ``--create`` makes it.

It names an embedded server as such only when a router started it on the config's store and
port; a foreign server on that port is an error.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import nats
import yaml
from nats.js.errors import NotFoundError

from brokers.nats import EmbeddedNats
from tests.conftest import NATS_URL, NatsStreams
from tests.contract.harnesses import REDIS_URL
from tests.e2e.helpers import Serving, copy_default_config, router
from tests.services import free_port


def write_config(folder: Path, url: str, stream: tuple[str, str], **stream_extra: Any) -> None:
    name, subject = stream
    broker = {
        "type": "nats",
        "url": NATS_URL,
        "internal": True,
        "destination": subject + ".{event_type}",
        "stream": {"name": name, "subjects": [subject + ".>"], "storage": "memory"} | stream_extra,
    }
    config = {"databases": {"main": url}, "brokers": {"events": broker}}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))


async def stream_exists(name: str) -> bool:
    client = await nats.connect(NATS_URL)
    try:
        await client.jetstream().stream_info(name)
    except NotFoundError:
        return False
    finally:
        await client.close()
    return True


def broker_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("broker"))


async def test_check_reports_a_missing_stream_and_creates_nothing(
    pg_url: str, nats_streams: NatsStreams, tmp_path: Path
) -> None:
    stream = nats_streams.stream("check")
    write_config(tmp_path, pg_url, stream)
    result = await asyncio.to_thread(router, "check", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert broker_line(result.stdout).endswith(
        f"reachable; stream '{stream[0]}' does not exist: serve creates it "
        "(or run router check --create)"
    )
    assert not await stream_exists(stream[0])

    created = await asyncio.to_thread(router, "check", "--create", cwd=tmp_path)
    assert created.returncode == 0, created.stdout + created.stderr
    assert broker_line(created.stdout).endswith(f"reachable, stream '{stream[0]}' ready")
    assert await stream_exists(stream[0])


async def test_check_fails_a_missing_stream_that_serve_would_not_create(
    pg_url: str, nats_streams: NatsStreams, tmp_path: Path
) -> None:
    stream = nats_streams.stream("nocreate")
    write_config(tmp_path, pg_url, stream, create=False)
    for args in (["check"], ["check", "--create"]):
        result = await asyncio.to_thread(router, *args, cwd=tmp_path)
        assert result.returncode == 1
        assert broker_line(result.stdout).endswith(
            f"FAILED  nats nats://127.0.0.1:4222  events: stream '{stream[0]}' does not exist "
            "and stream.create is off"
        )
    assert not await stream_exists(stream[0])


def test_a_foreign_server_on_the_embedded_port_is_an_error(tmp_path: Path) -> None:
    copy_default_config(tmp_path)
    env = {"NATS_URL": NATS_URL, "PARTNER_NATS_URL": NATS_URL}  # the machine's own NATS
    assert router("init-db", cwd=tmp_path, env=env).returncode == 0
    result = router("check", cwd=tmp_path, env=env)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "router: embedded server: 127.0.0.1:4222 answers, but not as a server this config's "
        "router started (no such server on its store); stop the other process, or change "
        "the broker's url"
    )


def test_check_names_who_runs_the_embedded_server(tmp_path: Path) -> None:
    copy_default_config(tmp_path)
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    env = {"NATS_URL": url, "PARTNER_NATS_URL": url, "ROUTER_HTTP_BIND": f"127.0.0.1:{free_port()}"}
    assert router("init-db", cwd=tmp_path, env=env).returncode == 0

    alone = router("check", cwd=tmp_path, env=env)
    assert alone.returncode == 0, alone.stdout + alone.stderr
    assert f"(embedded server on 127.0.0.1:{port}, started for this command)" in alone.stdout

    serving = Serving(tmp_path, env)
    try:
        serving.wait_for("router.started")
        beside = router("check", cwd=tmp_path, env=env)
        pid = int((tmp_path / "var" / "nats" / "nats-server.pid").read_text())
    finally:
        assert serving.stop() == 0
    assert beside.returncode == 0, beside.stdout + beside.stderr
    assert f"(embedded server of a running router on 127.0.0.1:{port} (pid {pid}))" in (
        beside.stdout
    )


EVENTS = """
from router import Event

class Placed(Event, type="placed", published=True):
    order_id: str

class Shipped(Event, type="shipped", published=True):
    order_id: str
"""


async def test_check_fails_a_destination_no_subject_of_the_stream_captures(
    pg_url: str, nats_streams: NatsStreams, tmp_path: Path
) -> None:
    name, subject = nats_streams.stream("uncaptured")
    write_config(tmp_path, pg_url, (name, subject))
    config = (tmp_path / "config.yaml").read_text()
    (tmp_path / "config.yaml").write_text(
        config.replace(f"{subject}.{{event_type}}", "orders.{event_type}")
    )

    result = await asyncio.to_thread(router, "check", cwd=tmp_path)

    assert result.returncode == 1, result.stdout + result.stderr
    assert broker_line(result.stdout).endswith(
        f"FAILED  nats nats://127.0.0.1:4222  reachable; stream '{name}' does not exist: serve "
        "creates it (or run router check --create); destination 'orders.{event_type}': no "
        f"subject it makes is captured by stream '{name}' (subjects ['{subject}.>']); stage() "
        "refuses every event sent there"
    )


async def test_check_fails_an_event_whose_subject_the_stream_does_not_capture(
    pg_url: str, nats_streams: NatsStreams, tmp_path: Path
) -> None:
    name, subject = nats_streams.stream("oneevent")
    (tmp_path / "check_events.py").write_text(EVENTS)
    broker = {
        "type": "nats",
        "url": NATS_URL,
        "internal": True,
        "destination": subject + ".{event_type}",
        "stream": {"name": name, "subjects": [f"{subject}.placed"], "storage": "memory"},
    }
    config = {
        "events": ["check_events"],
        "databases": {"main": pg_url},
        "brokers": {"events": broker},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))

    result = await asyncio.to_thread(router, "check", cwd=tmp_path)

    assert result.returncode == 1, result.stdout + result.stderr
    assert broker_line(result.stdout).endswith(
        f"destination '{subject}.{{event_type}}' for shipped v1: subject '{subject}.shipped' is "
        f"not captured by stream '{name}' (subjects ['{subject}.placed']); stage() refuses it"
    )
    assert f"{subject}.placed'" not in broker_line(result.stdout).split("for shipped")[0]


TWO_VERSIONS = """
from router import Event

class OrderPlacedV1(Event, type="orders.order_placed", version=1, published=True):
    order_id: str
    total: str

class OrderPlaced(Event, type="orders.order_placed", version=2, published=True):
    order_id: str
    total_cents: int
    currency: str
"""


async def test_check_accepts_a_projection_of_the_newest_version_only_with_a_warning(
    pg_url: str, nats_streams: NatsStreams, tmp_path: Path
) -> None:
    name, subject = nats_streams.stream("projection")
    (tmp_path / "two_versions.py").write_text(TWO_VERSIONS)
    stream = {"name": name, "subjects": [f"{subject}.>"], "storage": "memory"}
    partner = {"type": "nats", "url": NATS_URL, "destination": subject + ".{event_type}"}
    # What releases before TYPE@VERSION accepted: version 1 got order_id only.
    projection = {"orders.order_placed": ["order_id", "total_cents", "currency"]}
    config = {
        "events": ["two_versions"],
        "databases": {"main": pg_url},
        "brokers": {"billing": partner | {"stream": stream, "expose": {"payload": projection}}},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))

    warned = await asyncio.to_thread(router, "--log-format", "json", "check", cwd=tmp_path)
    projection["orders.order_placed@1"] = ["order_id"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    replaced = await asyncio.to_thread(router, "check", cwd=tmp_path)

    assert warned.returncode == 0, warned.stdout + warned.stderr
    records = [json.loads(line) for line in warned.stderr.splitlines()]
    assert [(r["level"], r["event"], r["problem"]) for r in records] == [
        (
            "warning",
            "config.deprecated",
            "brokers.billing.expose.payload.orders.order_placed: version 1 has no field "
            "'total_cents', 'currency', so its messages carry order_id only; to keep that, add "
            "under expose.payload: 'orders.order_placed@1: [order_id]' (or list the version 1 "
            "fields this partner should get); a later release refuses the list without it",
        )
    ]
    assert replaced.returncode == 0, replaced.stdout + replaced.stderr
    assert "config.deprecated" not in replaced.stderr


async def test_check_warns_when_an_atomic_streams_duplicate_window_is_short(
    pg_url: str, tmp_path: Path
) -> None:
    """An atomic target's unit sent again after its commit's answer was lost is recognised
    only within the stream's duplicate window: shorter than the retry horizon (lease 30 s,
    publish limit 16 s, probe 3 s: 49 s), check warns, and passes."""
    url = f"nats://127.0.0.1:{free_port()}"
    server = EmbeddedNats(url, tmp_path / "nats")  # atomic batches: nats-server 2.12+
    await server.start()
    try:
        for window, warned in ((10, True), (120, False)):
            folder = tmp_path / str(window)
            folder.mkdir()
            broker = {
                "type": "nats",
                "url": url,
                "internal": True,
                "atomic": True,
                "destination": f"w{window}.{{event_type}}",
                "stream": {
                    "name": f"W{window}",
                    "subjects": [f"w{window}.>"],
                    "duplicate_window_seconds": window,
                },
            }
            config = {"databases": {"main": pg_url}, "brokers": {"events": broker}}
            (folder / "config.yaml").write_text(yaml.safe_dump(config))
            result = await asyncio.to_thread(router, "check", "--create", cwd=folder)
            assert result.returncode == 0, result.stdout + result.stderr
            line = broker_line(result.stdout)
            warning = (
                f"WARNING: atomic, and the duplicate window is {window} s: a unit sent again "
                "after its commit's answer was lost (up to 49 s later"
            )
            assert (warning in line) is warned, line
    finally:
        await server.stop()


async def test_check_warns_when_an_atomic_redis_targets_duplicate_window_is_short(
    pg_url: str, tmp_path: Path
) -> None:
    """The same on Redis, whose window is how long each unit's marker is kept."""
    for window, warned in ((10, True), (120, False)):
        folder = tmp_path / str(window)
        folder.mkdir()
        broker = {
            "type": "redis",
            "url": REDIS_URL,
            "internal": True,
            "atomic": True,
            "destination": "w.{event_type}",
            "duplicate_window_seconds": window,
        }
        config = {"databases": {"main": pg_url}, "brokers": {"events": broker}}
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
        result = await asyncio.to_thread(router, "check", cwd=folder)
        assert result.returncode == 0, result.stdout + result.stderr
        line = broker_line(result.stdout)
        warning = f"WARNING: atomic, and the duplicate window is {window} s: a unit sent again"
        assert (warning in line) is warned, line
