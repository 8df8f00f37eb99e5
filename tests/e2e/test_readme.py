"""README.md's shell samples are the real output of the current code.

A fenced block right after ``<!-- readme-test: SETUP -->`` is a sample: each ``$ COMMAND``
line is run in a fresh copy of the embedded default (config.yaml and examples/ in a temp
folder, SQLite and the embedded NATS server on free ports), and the lines under it must be
the first lines of what the command printed (its stdout, or its stderr when stdout is empty).
Only what must vary is normalised: times, durations, ids, worker ids (host:pid:tag), the temp
folder, the free ports (mapped back to the shipped 4333 and 8642), attempt counts and rates,
and runs of spaces (table widths follow the values). ``…`` in a README line stands for the
rest of a JSON string and ``{...}`` for a JSON object: the README shortens long bodies.

SETUP names the state the commands run in (see ``SETUPS``); an unknown one fails.
Nothing here is skipped: it needs no outside service.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import sqlite3
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.e2e.helpers import ROOT, Serving, python, router
from tests.services import free_port

README = ROOT / "README.md"
SHIPPED_NATS, SHIPPED_HTTP = "127.0.0.1:4333", "127.0.0.1:8642"

FRESH = "embedded default, fresh"
INIT_DB = "embedded default after init-db"
PARTNER_DOWN = (
    "embedded default with serve running and the partner broker down, after examples/shop/app.py"
)
QUICKSTART = "output of the Quickstart commands, with serve running; messages in any order"
SETUPS = (FRESH, INIT_DB, PARTNER_DOWN, QUICKSTART)

pytestmark = pytest.mark.timeout(120)


@dataclass
class Sample:
    """One marked block of README.md."""

    setup: str
    line: int
    commands: list[tuple[str, list[str]]] = field(default_factory=list)
    output: list[str] = field(default_factory=list)  # a block without `$` lines


def samples() -> list[Sample]:
    """Every ``<!-- readme-test: ... -->`` block of README.md."""
    text = README.read_text(encoding="utf-8")
    found = []
    pattern = r"^<!-- readme-test: (.*?) -->\n```[a-z]*\n(.*?)^```"
    for match in re.finditer(pattern, text, re.MULTILINE | re.DOTALL):
        sample = Sample(match[1].strip(), text[: match.start()].count("\n") + 1)
        for raw in match[2].splitlines():
            if raw.startswith("$ "):
                sample.commands.append((raw[2:], []))
            elif sample.commands:
                sample.commands[-1][1].append(raw)
            else:
                sample.output.append(raw)
        for _, expected in sample.commands:
            while expected and not expected[-1].strip():  # the blank line before the next `$`
                expected.pop()
        found.append(sample)
    return found


SAMPLES = samples()


def test_the_readme_marks_its_samples() -> None:
    setups = {s.setup for s in SAMPLES}
    assert setups <= set(SETUPS), f"unknown readme-test setup(s): {setups - set(SETUPS)}"
    assert setups == set(SETUPS), f"no README sample with setup(s) {set(SETUPS) - setups}"
    for sample in SAMPLES:
        assert sample.commands or sample.setup == QUICKSTART, sample
        assert all(expected for _, expected in sample.commands), (
            f"a command without output: {sample}"
        )


class Copy:
    """A temp copy of the embedded default, on free ports."""

    def __init__(self, folder: Path, partner_down: bool = False) -> None:
        self.folder = folder
        shutil.copy(ROOT / "config.yaml", folder / "config.yaml")
        shutil.copytree(ROOT / "examples", folder / "examples")
        (folder / ".venv").symlink_to(ROOT / ".venv")
        self.nats, self.http = free_port(), free_port()
        self.dead = free_port()  # nothing listens there
        partner = self.dead if partner_down else self.nats
        self.env = {  # the shipped defaults, whatever the caller's environment says
            "DATABASE_URL": "sqlite:///./var/shop.db",
            "NATS_URL": f"nats://127.0.0.1:{self.nats}",
            "PARTNER_NATS_URL": f"nats://127.0.0.1:{partner}",
            "ROUTER_HTTP_BIND": f"127.0.0.1:{self.http}",
            "ROUTER_CONFIG": "config.yaml",
            "ROUTER_LOG_LEVEL": "info",
            "ROUTER_LOG_FORMAT": "text",
            "ROUTER_WORKERS": "1",
            "COLUMNS": "80",  # argparse wraps --help to the terminal's width
        }

    def run(self, command: str) -> str:
        """Run one README command line here; its stdout (or stderr when stdout is empty)."""
        words = shlex.split(command)
        done: subprocess.CompletedProcess[str]
        if words[0] == "router":
            done = router(*words[1:], cwd=self.folder, env=self.env, timeout=30)
        elif words[0] == ".venv/bin/python":
            done = python(*words[1:], cwd=self.folder, env=self.env, timeout=30)
        else:
            pytest.fail(f"README sample command not understood: {command}")
        return done.stdout or done.stderr

    def normalise(self, text: str) -> list[str]:
        """What may vary between runs, made equal; see the module docstring."""
        text = text.replace(str(self.folder), "<dir>")
        text = text.replace(f"127.0.0.1:{self.nats}", SHIPPED_NATS)
        text = text.replace(f"127.0.0.1:{self.http}", SHIPPED_HTTP)
        text = text.replace(f"127.0.0.1:{self.dead}", "127.0.0.1:4334")
        return [normalise_line(line) for line in text.splitlines()]


UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
RULES = (
    (re.compile(UUID), "<id>"),
    (re.compile(r"\bsha256:[0-9a-f]{64}\b"), "sha256:<hash>"),
    (re.compile(r"\b(checkout-)[0-9a-f]{8}\b"), r"\1<id>"),  # the example's correlation ids
    (re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)?"), "<time>"),
    (re.compile(r"\b\d\d:\d\d:\d\d(\.\d+)?\b"), "<time>"),
    (re.compile(r"\b[\w.-]+:\d+:[0-9a-f]{6}\b"), "<worker>"),
    (re.compile(r"\b\d+\.\d+(ms|s|m|h)\b"), "<age>"),
    (re.compile(r"\b\d+\.\d+\b"), "<rate>"),
    (re.compile(r"\b(failed|processing|pending|published) +\d+\b"), r"\1 <attempts>"),
    (re.compile(r" {2,}"), " "),
)


def normalise_line(line: str) -> str:
    """One line with its varying parts replaced by placeholders."""
    for pattern, replacement in RULES:
        line = pattern.sub(replacement, line)
    return line.rstrip()


def matches(expected: str, actual: str) -> bool:
    """``actual`` is ``expected``, where the README's ``…`` and ``{...}`` shorten it."""
    if "…" not in expected and "{...}" not in expected:
        return expected == actual
    pattern = re.escape(expected).replace("…", '[^"]*').replace(r"\{\.\.\.\}", r"\{[^{}]*\}")
    return re.fullmatch(pattern, actual) is not None


def compare(copy: Copy, command: str, expected: list[str], attempts: int = 1) -> None:
    """The real output of ``command`` starts with the README's lines (tried a few times when
    the state the sample shows may be passing through a transition)."""
    want = [normalise_line(line) for line in expected]
    for attempt in range(attempts):
        got = copy.normalise(copy.run(command))
        if len(got) >= len(want) and all(map(matches, want, got)):
            return
        if attempt + 1 < attempts:
            time.sleep(0.5)
    diff = "\n".join(
        f"{'  ' if i < len(got) and matches(w, got[i]) else '! '}README: {w}\n"
        f"  real:   {got[i] if i < len(got) else '<missing>'}"
        for i, w in enumerate(want)
    )
    pytest.fail(f"README sample `$ {command}` is not the real output:\n{diff}")


def of(setup: str) -> list[Sample]:
    """The README's samples with this setup."""
    return [s for s in SAMPLES if s.setup == setup]


@pytest.fixture
def copy(tmp_path: Path) -> Copy:
    return Copy(tmp_path)


def test_fresh_samples(copy: Copy) -> None:
    for sample in of(FRESH):
        folder = copy.folder / "var"
        if folder.exists():  # each sample starts fresh
            shutil.rmtree(folder)
        for command, expected in sample.commands:
            compare(copy, command, expected)


def test_samples_after_init_db(copy: Copy) -> None:
    assert copy.run("router init-db")
    for sample in of(INIT_DB):
        for command, expected in sample.commands:
            compare(copy, command, expected)


@pytest.fixture
def serving(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Copy, Serving]]:
    copy = Copy(tmp_path, partner_down=request.param)
    assert copy.run("router init-db")
    serve = Serving(tmp_path, copy.env)
    try:
        serve.wait_for("router.started")
        yield copy, serve
    finally:
        code = serve.stop()
        assert code == 0, serve.log.read_text()


def status_of(copy: Copy) -> dict[str, dict[str, object]]:
    found = json.loads(copy.run("router status --json"))
    return {t["target"]: t for t in found["targets"]}


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out: {what}")
        time.sleep(0.2)


@pytest.mark.parametrize("serving", [True], indirect=True)
def test_operations_samples_with_the_partner_down(serving: tuple[Copy, Serving]) -> None:
    copy, _ = serving
    copy.run(".venv/bin/python examples/shop/app.py")

    def settled() -> bool:
        targets = status_of(copy)
        return targets["events"]["published"] == 6 and targets["partners"]["failed"] == 3

    wait_for(settled, "6 events published and 3 partner rows retrying")
    with sqlite3.connect(copy.folder / "var/shop.db") as db:
        (message_id,) = db.execute(
            "SELECT message_id FROM router_outbox WHERE target = 'partners' LIMIT 1"
        ).fetchone()
    for sample in of(PARTNER_DOWN):
        for command, expected in sample.commands:
            command = re.sub(UUID, message_id, command)
            compare(copy, command, expected, attempts=6)


@pytest.mark.parametrize("serving", [False], indirect=True)
def test_quickstart_output(serving: tuple[Copy, Serving]) -> None:
    copy, _ = serving
    quickstart = re.search(
        r"^## Quickstart\n.*?^```bash\n(.*?)^```", README.read_text(), re.MULTILINE | re.DOTALL
    )
    assert quickstart, "README.md has no Quickstart commands"
    app, listen = (line.split("#")[0].strip() for line in quickstart[1].strip().splitlines())
    copy.run(app)
    wait_for(
        lambda: (
            status_of(copy)["partners"]["published"] == 3
            and status_of(copy)["events"]["published"] == 6
        ),
        "the Quickstart's 9 messages delivered",
    )
    got = copy.normalise(copy.run(listen))
    for sample in of(QUICKSTART):
        want = [normalise_line(line) for line in sample.output]
        heads = [i for i, line in enumerate(want) if line.startswith("[")]
        tail = [line for line in (want[heads[-1] + 2 :] if heads else want) if line != "…"]
        assert got[-len(tail) :] == tail, f"README: {tail}\nreal: {got[-len(tail) :]}"
        pairs = [(got[i], got[i + 1]) for i, line in enumerate(got) if line.startswith("[")]
        for i in heads:
            found = [p for p in pairs if matches(want[i], p[0]) and matches(want[i + 1], p[1])]
            assert found, (
                f"README.md line {sample.line}: no real message like\n{want[i]}\n{want[i + 1]}"
                "\nreal:\n" + "\n".join(f"{h}\n{b}" for h, b in pairs)
            )
            pairs.remove(found[0])
