"""The shipped config.yaml, as a newcomer runs it: SQLite + the embedded NATS server."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

from brokers.nats import find_nats_server
from envelopes import INTERNAL_ONLY_FIELDS
from router.ops.migrate import head_revision
from tests.e2e.helpers import Serving, copy_default_config, python, router
from tests.services import free_port, reachable

HEAD = head_revision()


def test_router_serve_delivers_the_example_events(tmp_path: Path) -> None:
    copy_default_config(tmp_path)
    env = _default_env()
    port = int(env["NATS_URL"].rsplit(":", 1)[1])

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
        env = {"NATS_URL": f"nats://127.0.0.1:{port}", "ROUTER_HTTP_BIND": _free_bind()}
        assert router("init-db", cwd=tmp_path, env=env).returncode == 0
        serving = Serving(tmp_path, env)
        code = serving.process.wait(30)
    assert code == 1
    assert f"127.0.0.1:{port} is already taken" in serving.log.read_text()


def _default_env() -> dict[str, str]:
    """The shipped config's variables with ports of the test's own: the tests run two at a
    time, and the README's command (tests/e2e/test_install.py) serves on the shipped
    config's own HTTP port meanwhile."""
    port = free_port()
    return {
        "NATS_URL": f"nats://127.0.0.1:{port}",
        "PARTNER_NATS_URL": f"nats://127.0.0.1:{port}",
        "DATABASE_URL": "sqlite:///./var/shop.db",
        "ROUTER_HTTP_BIND": _free_bind(),
    }


def _free_bind() -> str:
    return f"127.0.0.1:{free_port()}"


def test_a_second_router_on_the_same_store_refuses_and_leaves_the_first_alone(
    tmp_path: Path,
) -> None:
    copy_default_config(tmp_path)
    env = _default_env()
    port = env["NATS_URL"].rsplit(":", 1)[1]
    assert router("init-db", cwd=tmp_path, env=env).returncode == 0
    first = Serving(tmp_path, env)
    try:
        first.wait_for("router.started")
        second_env = {**env, "ROUTER_HTTP_BIND": f"127.0.0.1:{free_port()}"}
        second = router("serve", cwd=tmp_path, env=second_env, timeout=30)
        assert second.returncode == 2, second.stderr
        errors = [line for line in second.stderr.splitlines() if line.startswith("router: ")]
        assert errors == [
            f"router: embedded NATS on 127.0.0.1:{port} is run by another router "
            f"(pid {first.process.pid}, store {tmp_path / 'var' / 'nats'}); stop that one "
            "first, or give this one another url and store_dir"
        ]
        assert "Traceback" not in second.stderr
        assert "stale_server_stopped" not in second.stderr
        # The first router still has its broker, and keeps delivering.
        app = python("examples/shop/app.py", "-c", "config.yaml", "-n", "1", cwd=tmp_path, env=env)
        assert app.returncode == 0, app.stderr
        listened = python(
            "examples/shop/listen.py", "-c", "config.yaml", "--once", "--idle", "1.5",
            cwd=tmp_path, env=env,
        )  # fmt: skip
        assert listened.returncode == 0, listened.stderr
        assert "events: 2 message(s)" in listened.stdout.splitlines()
    finally:
        code = first.stop()
    assert code == 0, first.log.read_text()
    assert "nats.embedded.stale_server_stopped" not in first.log.read_text()


def test_a_server_left_by_a_dead_router_is_stopped(tmp_path: Path) -> None:
    copy_default_config(tmp_path)
    env = _default_env()
    port = env["NATS_URL"].rsplit(":", 1)[1]
    store = tmp_path / "var" / "nats"
    store.mkdir(parents=True)
    # What a router killed with SIGKILL leaves where no parent-death signal reaches the
    # server: the server, its pid file, and a lock file nobody holds.
    (store / "router.lock").write_text("999999\n")
    left = subprocess.Popen(
        [str(find_nats_server()), "-js", "-sd", str(store / "jetstream"), "-a", "127.0.0.1",
         "-p", port, "-P", str(store / "nats-server.pid")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while not reachable("127.0.0.1", int(port)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert router("init-db", cwd=tmp_path, env=env).returncode == 0
        serving = Serving(tmp_path, env)
        try:
            serving.wait_for("router.started")
            assert left.wait(10) is not None
        finally:
            code = serving.stop()
    finally:
        if left.poll() is None:
            left.kill()
            left.wait()
    assert code == 0, serving.log.read_text()
    assert f"nats.embedded.stale_server_stopped pid={left.pid}" in serving.log.read_text()
