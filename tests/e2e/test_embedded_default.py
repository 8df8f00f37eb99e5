"""The shipped config.yaml, as a newcomer runs it: SQLite + the embedded NATS server."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from envelopes import INTERNAL_ONLY_FIELDS
from router.ops.migrate import head_revision
from tests.e2e.helpers import Serving, copy_default_config, python, router
from tests.services import free_port, reachable

HEAD = head_revision()


def test_router_serve_delivers_the_example_events(tmp_path: Path) -> None:
    copy_default_config(tmp_path)
    port = free_port()
    env = {"NATS_URL": f"nats://127.0.0.1:{port}", "PARTNER_NATS_URL": f"nats://127.0.0.1:{port}"}
    env["DATABASE_URL"] = "sqlite:///./var/shop.db"

    created = router("init-db", cwd=tmp_path, env=env)
    assert created.returncode == 0, created.stderr
    assert f"upgraded empty -> {HEAD}" in created.stdout
    again = router("init-db", cwd=tmp_path, env=env)
    assert "nothing to do" in again.stdout

    serving = Serving(tmp_path, env)
    try:
        serving.wait_for("router.started")
        assert reachable("127.0.0.1", port)
        app = python("examples/shop/app.py", "-c", "config.yaml", "-n", "2", cwd=tmp_path, env=env)
        assert app.returncode == 0, app.stderr
        listened = python(
            "examples/shop/listen.py",
            "-c",
            "config.yaml",
            "--once",
            "--idle",
            "1.5",
            cwd=tmp_path,
            env=env,
        )
        assert listened.returncode == 0, listened.stderr
    finally:
        code = serving.stop()
    assert code == 0, serving.log.read_text()
    assert not reachable("127.0.0.1", port)  # the embedded server stopped with the router

    lines = listened.stdout.splitlines()
    assert "events: 4 message(s)" in lines
    assert "partners: 2 message(s)" in lines
    partner_bodies = [
        json.loads(lines[i + 1]) for i, line in enumerate(lines) if line.startswith("[partners]")
    ]
    assert [b["type"] for b in partner_bodies] == ["order_placed", "order_placed"]
    for body in partner_bodies:
        assert not set(body) & INTERNAL_ONLY_FIELDS
        assert body["source"] == "shop"
    log = serving.log.read_text()
    assert "processor.stopped database=main target=events published=4" in log
    assert "processor.stopped database=main target=partners published=2" in log


def test_a_taken_port_is_reported_plainly(tmp_path: Path) -> None:
    copy_default_config(tmp_path)
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        env = {"NATS_URL": f"nats://127.0.0.1:{port}"}
        assert router("init-db", cwd=tmp_path, env=env).returncode == 0
        serving = Serving(tmp_path, env)
        code = serving.process.wait(30)
    assert code == 1
    assert f"127.0.0.1:{port} is already taken" in serving.log.read_text()
