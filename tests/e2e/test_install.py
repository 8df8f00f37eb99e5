"""The install as a user does it: a fresh copy of the project and the README's first command.

The copy holds the files ``git ls-files`` lists (from the working tree). In it, the README's
first ```bash block runs exactly as written (a new venv, ``pip install -e .`` without extras,
``router init-db``, ``router serve``), then the Quickstart commands, then SIGTERM. The same
venv then gets only the ``kafka`` extra, and a config naming a Redis broker must be refused
by ``router check`` and ``router serve`` with the broker's YAML path and the pip extra.

Nothing here is skipped: the install must work wherever the suite runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from envelopes import INTERNAL_ONLY_FIELDS
from tests.services import free_port

ROOT = Path(__file__).resolve().parents[2]

# The ports of the shipped config.yaml: its `http: bind:` and the embedded NATS server's URL.
HTTP = ("127.0.0.1", 8642)
NATS = ("127.0.0.1", 4333)

INSTALL_TIMEOUT = 240.0  # venv + pip install -e . + init-db until serve is ready
STOP_TIMEOUT = 10.0  # SIGTERM until router serve has exited
# With nothing in flight a stop finishes at once: it must neither wait out the grace period
# (shutdown_grace_seconds, 10 s) nor need the embedded NATS server's SIGKILL (after 5 s).
IDLE_STOP = 5.0
EXTRAS = (
    "faststream",
    "aiokafka",
    "redis",
    "aio_pika",
    "azure",
    "opentelemetry",
    "asyncpg",  # the postgresql extra: the embedded default needs no PostgreSQL driver
    "asyncmy",
    "django",
    "pytest",
)

pytestmark = pytest.mark.timeout(600)


def readme_block(after: str | None = None) -> str:
    """The first ```bash block of README.md (after the heading ``after``, if given)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    if after is not None:
        heading = re.search(rf"^{re.escape(after)}\s*$", text, re.MULTILINE)
        assert heading, f"README.md has no {after!r} heading"
        text = text[heading.end() :]
    block = re.search(r"^```bash\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert block, "README.md has no ```bash block"
    return block.group(1).strip()


def user_env() -> dict[str, str]:
    """This machine's environment as a user's shell has it: no venv, no test overrides."""
    env = dict(os.environ)
    for name in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "ROUTER_CONFIG"):
        env.pop(name, None)
    for name in list(env):
        if name.startswith("ROUTER_") or name in ("DATABASE_URL", "NATS_URL", "PARTNER_NATS_URL"):
            del env[name]
    if sys.prefix != sys.base_prefix:  # drop an activated dev venv from PATH
        venv_bin = str(Path(sys.prefix) / "bin")
        env["PATH"] = os.pathsep.join(
            p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin
        )
    return env


def copy_clone(target: Path) -> None:
    """The files a fresh clone has (as ``git ls-files`` lists them), from the working tree."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=30
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if not source.is_symlink() and not source.is_file():
            continue  # deleted in the working tree, or a submodule
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target / name, follow_symlinks=False)


def port_free(address: tuple[str, int]) -> bool:
    """True when a server may bind ``address`` now (as asyncio binds: SO_REUSEADDR)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError:
            return False
        return True


def wait_until(
    condition: Callable[[], bool], timeout: float, what: Callable[[], str], step: float = 0.2
) -> None:
    """Poll ``condition`` until true; fail with ``what()`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s: {what()}")
        time.sleep(step)


def get_json(path: str) -> tuple[int, Any]:
    """GET ``path`` from the router's HTTP port: (status, JSON body); (0, None) if unreachable."""
    url = f"http://{HTTP[0]}:{HTTP[1]}{path}"
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")
    except (OSError, ValueError):
        return 0, None


def process_group(pgid: int) -> list[tuple[int, int, list[str]]]:
    """(pid, parent pid, argv) of every live process in group ``pgid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # state, ppid, pgrp, ...
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append((int(entry.name), int(fields[1]), [a for a in argv if a]))
    return found


class ReadmeRun:
    """The README's first command, run by bash in its own process group, logged to a file."""

    def __init__(self, folder: Path, command: str) -> None:
        self.folder = folder
        self.command = command
        self.log = folder / "readme-command.log"
        with self.log.open("w") as log:
            self.bash = subprocess.Popen(
                ["bash", "-c", command],
                cwd=folder,
                env=user_env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                process_group=0,
            )

    def tail(self, lines: int = 60) -> str:
        """The log's last lines, for failure messages."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return f"--- {self.log} (last {lines} lines) ---\n" + "\n".join(text.splitlines()[-lines:])

    def serve_pid(self) -> int | None:
        """The pid of ``router serve``: bash itself (if it exec'd it) or bash's child."""
        for pid, parent, argv in process_group(self.bash.pid):
            if self.bash.pid in (pid, parent):
                is_router = any(a == "router" or a.endswith("/router") for a in argv)
                if is_router and "serve" in argv:
                    return pid
        return None

    def ready(self) -> bool:
        """True once serve logged its start and /readyz answers ready; fails if bash exited."""
        if self.bash.poll() is not None:
            pytest.fail(
                f"the README command exited with code {self.bash.returncode} before "
                f"`router serve` was ready:\n  {self.command}\n{self.tail()}"
            )
        log = self.log.read_text(errors="replace")
        if "Traceback" in log:
            pytest.fail(f"the README command printed a traceback:\n{self.tail()}")
        if "router.started" not in log or f"http.started bind={HTTP[0]}:{HTTP[1]}" not in log:
            return False
        status, body = get_json("/readyz")
        return status == 200 and isinstance(body, dict) and body.get("status") == "ready"

    def kill(self) -> None:
        """Kill whatever is left of the process group (after a failure)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.bash.poll() is not None and not process_group(self.bash.pid):
                return  # all gone: the group id is no longer ours to signal
            try:
                os.killpg(self.bash.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.bash.wait(5)
            except subprocess.TimeoutExpired:
                continue
            if not process_group(self.bash.pid):
                break


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReadmeRun]:
    """A fresh copy of the project with the README's first command serving in it."""
    folder = tmp_path_factory.mktemp("clone")
    copy_clone(folder)
    # The shipped config's ports are fixed; another router (a test elsewhere on this machine)
    # may hold them for a few seconds.
    wait_until(
        lambda: port_free(HTTP) and port_free(NATS),
        60,
        lambda: f"{HTTP} or {NATS} stays taken; the README's router cannot start",
    )
    run = ReadmeRun(folder, readme_block())
    try:
        wait_until(run.ready, INSTALL_TIMEOUT, lambda: f"router serve not ready\n{run.tail()}")
        yield run
    finally:
        run.kill()


def run_line(line: str, folder: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """One shell line in the clone, as a user types it."""
    return subprocess.run(
        ["bash", "-c", line],
        cwd=folder,
        env=user_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def venv_has(folder: Path, *modules: str) -> dict[str, bool]:
    """Which top-level modules the clone's venv can import (nothing is imported)."""
    code = (
        "import importlib.util, json, sys; "
        "print(json.dumps({m: importlib.util.find_spec(m) is not None for m in sys.argv[1:]}))"
    )
    found = subprocess.run(
        [str(folder / ".venv/bin/python"), "-c", code, *modules],
        cwd=folder,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result: dict[str, bool] = json.loads(found.stdout)
    return result


def messages(listen_output: str) -> dict[str, list[tuple[str, str, dict[str, Any]]]]:
    """listen.py's printout per broker: (subject, Nats-Msg-Id, body) of each message."""
    lines = listen_output.splitlines()
    found: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
    for i, line in enumerate(lines):
        head = re.fullmatch(r"\[(\w+)\] (\S+)  Nats-Msg-Id=(\S+)", line)
        if head:
            assert lines[i + 1].startswith("    "), listen_output
            body = json.loads(lines[i + 1])
            found.setdefault(head[1], []).append((head[2], head[3], body))
    return found


def test_readme_command_installs_serves_the_quickstart_and_stops_on_sigterm(
    readme_run: ReadmeRun,
) -> None:
    folder = readme_run.folder
    # A plain install: only the core dependencies, no extra and no dev tool.
    assert venv_has(folder, *EXTRAS) == dict.fromkeys(EXTRAS, False)
    assert venv_has(folder, "nats", "aiosqlite") == dict.fromkeys(("nats", "aiosqlite"), True)

    quickstart = readme_block(after="## Quickstart").splitlines()
    assert len(quickstart) == 2, quickstart
    assert "examples/shop/app.py" in quickstart[0], quickstart
    assert "examples/shop/listen.py --once" in quickstart[1], quickstart

    app = run_line(quickstart[0], folder)
    assert app.returncode == 0, f"{quickstart[0]}\n{app.stdout}{app.stderr}\n{readme_run.tail()}"
    orders = re.findall(
        r"^placed order ([0-9a-f-]{36}): staged order_placed \+ stock_reserved$",
        app.stdout,
        re.MULTILINE,
    )
    assert len(orders) == 3, app.stdout
    assert len(app.stdout.splitlines()) == 3, app.stdout

    def delivered() -> bool:
        status, body = get_json("/api/outbox")
        if status != 200 or not isinstance(body, dict):
            return False
        targets = {t["target"]: t for t in body["targets"]}
        return set(targets) == {"events", "partners"} and all(
            t[k] == 0
            for t in targets.values()
            for k in ("pending", "in_flight", "failed", "abandoned")
        )

    wait_until(delivered, 30, lambda: f"the 6 rows were not delivered\n{readme_run.tail()}")

    listen = run_line(quickstart[1], folder)
    assert listen.returncode == 0, f"{quickstart[1]}\n{listen.stdout}{listen.stderr}"
    lines = listen.stdout.splitlines()
    assert lines[-2:] == ["events: 6 message(s)", "partners: 3 message(s)"], listen.stdout
    got = messages(listen.stdout)
    assert set(got) == {"events", "partners"}, listen.stdout

    # Per order: two messages on shop.* in the full internal envelope...
    internal: dict[tuple[str, str], dict[str, Any]] = {}
    for subject, msg_id, body in got["events"]:
        assert subject == f"shop.{body['type']}", (subject, body)
        assert msg_id == body["id"]
        internal[(body["payload"]["order_id"], body["type"])] = body
        assert body["stream"] == body["payload"]["order_id"]
        assert body["correlation_id"] == f"checkout-{body['stream'][:8]}"
        assert body["source"] == "shop"
        assert body["headers"] == {"channel": "web"}
        assert body["checksum"].startswith("sha256:")
        assert {"sequence", "asynchronous", "event_class"} <= set(body)
    assert sorted(internal) == sorted(
        (order, kind) for order in orders for kind in ("order_placed", "stock_reserved")
    )
    # ...and one on partners.order_placed in the external envelope, with the same message id.
    partner_orders = []
    for subject, msg_id, body in got["partners"]:
        assert subject == "partners.order_placed", subject
        order = body["payload"]["order_id"]
        partner_orders.append(order)
        same = internal[(order, "order_placed")]
        assert msg_id == body["id"] == same["id"]
        assert body["payload"] == same["payload"]
        assert not set(body) & INTERNAL_ONLY_FIELDS, body
        assert "headers" not in body, body  # staged headers stay home by default
        assert (body["source"], body["type"], body["version"]) == ("shop", "order_placed", 1)
    assert sorted(partner_orders) == sorted(orders)

    # SIGTERM to `router serve` (not to the group): it exits 0 within a few seconds.
    pid = readme_run.serve_pid()
    assert pid is not None, f"no `router serve` process under bash\n{readme_run.tail()}"
    os.kill(pid, signal.SIGTERM)
    started = time.monotonic()
    try:
        code = readme_run.bash.wait(STOP_TIMEOUT)  # bash ends with serve, with its exit code
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"router serve still runs {STOP_TIMEOUT:.0f} s after SIGTERM\n{readme_run.tail()}"
        )
    stopped_in = time.monotonic() - started
    log = readme_run.log.read_text(errors="replace")
    assert code == 0, f"exit code {code} after SIGTERM\n{readme_run.tail()}"
    assert stopped_in < IDLE_STOP, f"stopped in {stopped_in:.1f} s\n{readme_run.tail()}"
    assert "Traceback" not in log, readme_run.tail()
    assert "router.stopping signal=SIGTERM" in log, readme_run.tail()
    assert "processor.stopped database=main target=events published=6" in log, readme_run.tail()
    assert "processor.stopped database=main target=partners published=3" in log
    assert "router.stopped" in log, readme_run.tail()
    assert not process_group(readme_run.bash.pid), process_group(readme_run.bash.pid)
    assert port_free(NATS), "the embedded NATS server outlived router serve"


def test_a_broker_kind_without_its_extra_is_named_with_its_yaml_path(
    readme_run: ReadmeRun, tmp_path: Path
) -> None:
    folder = readme_run.folder
    pip = run_line(".venv/bin/pip install -e '.[kafka]'", folder, timeout=INSTALL_TIMEOUT)
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    # Exactly the kafka extra: FastStream and aiokafka are there, the Redis client is not.
    assert venv_has(folder, "faststream", "aiokafka", "redis") == {
        "faststream": True,
        "aiokafka": True,
        "redis": False,
    }

    nats_url = f"nats://127.0.0.1:{free_port()}"
    config = {
        "service": "shop",
        "databases": {"main": "sqlite:///./var/shop.db"},
        "brokers": {
            "events": {
                "type": "nats",
                "internal": True,
                "url": nats_url,
                "embedded": {"store_dir": "var/nats"},
                "destination": "shop.{event_type}",
                "stream": {"name": "SHOP", "subjects": ["shop.>"]},
            },
            "audit": {
                "type": "redis",
                "url": "redis://127.0.0.1:6379/0",
                "destination": "shop:{event_type}",
            },
        },
        "http": {"bind": f"127.0.0.1:{free_port()}"},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    router = str(folder / ".venv/bin/router")
    expected = [
        "router: config.yaml: 1 problem:",
        "  - brokers.audit: the redis broker needs its client library (redis is not installed):"
        " pip install 'outbox-router[redis]'",
    ]
    for command in ("check", "serve"):
        try:
            done = subprocess.run(
                [router, command],
                cwd=tmp_path,
                env=user_env(),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"router {command} did not exit within 60 s: {exc.stdout!r} {exc.stderr!r}")
        assert (done.returncode, done.stdout, done.stderr.splitlines()) == (2, "", expected), (
            command,
            done.returncode,
            done.stdout,
            done.stderr,
        )
    assert not (tmp_path / "var").exists()  # refused before anything opened
