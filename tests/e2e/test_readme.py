"""The shell samples of README.md and of every docs/**/*.md page are the real output of the
current code.

A fenced block right after ``<!-- readme-test: SETUP -->`` is a sample: each ``$ COMMAND``
line is run in a fresh copy of the embedded default (config.yaml and examples/ in a temp
folder, SQLite and the embedded NATS server on free ports), and the lines under it must be
the first lines of what the command printed (its stdout, or its stderr when stdout is empty).
Only what must vary is normalised: times, durations, ids, worker ids (host:pid:tag), the temp
folder, the free ports (mapped back to the shipped 4333 and 8642), attempt counts and rates,
and runs of spaces (table widths follow the values). ``…`` in a sample line stands for the
rest of a JSON string and ``{...}`` for a JSON object: the docs shorten long bodies.

SETUP names the state the commands run in (see ``SETUPS``); an unknown one fails, and every
one must be used by some page. Each sample is its own test, named by page and line.

Every other shell block (```bash, ```console, ```shell, or any block with a ``$ `` line) must
be in ``PROVEN_ELSEWHERE``, with the test that runs it: a new shell sample nobody runs fails.
(The Python and YAML blocks are tests/unit/test_docs_code.py's.)

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
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.docs_blocks import README, Block, every_block
from tests.e2e.helpers import ROOT, Serving, python, router
from tests.services import free_port

SHIPPED_NATS, SHIPPED_HTTP = "127.0.0.1:4333", "127.0.0.1:8642"

FRESH = "embedded default, fresh"
INIT_DB = "embedded default after init-db"
PARTNER_DOWN = (
    "embedded default with serve running and the partner broker down, after examples/shop/app.py"
)
QUICKSTART = "output of the Quickstart commands, with serve running; messages in any order"
SETUPS = (FRESH, INIT_DB, PARTNER_DOWN, QUICKSTART)

QUICKSTART_COMMANDS = """\
.venv/bin/python examples/shop/app.py          # commits 3 orders, each with 2 events
.venv/bin/python examples/shop/listen.py --once  # prints what arrived at each broker"""

FLASK_COMMANDS = """\
export ROUTER_CONFIG=flask_shop/config.yaml
export DATABASE_URL=postgresql://postgres@127.0.0.1:5432/shop
export NATS_URL=nats://127.0.0.1:4222

router init-db                                  # the outbox table
flask --app flask_shop.app create-tables        # the app's own table
router serve &                                  # delivers what the app commits
flask --app flask_shop.app run"""

FASTAPI_COMMANDS = """\
export ROUTER_CONFIG=fastapi_shop/config.yaml
export DATABASE_URL=postgresql://postgres@127.0.0.1:5432/shop
export NATS_URL=nats://127.0.0.1:4222

router init-db                                  # the outbox table
python -m fastapi_shop.app create-tables        # the app's own table
router serve &                                  # delivers what the app commits
uvicorn fastapi_shop.app:app"""

# Shell blocks that are not samples, each with what runs it. Keep it small: a block that can
# be a sample should be one.
PROVEN_ELSEWHERE = {
    "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/router init-db && "
    ".venv/bin/router serve": "README.md's first command: tests/e2e/test_install.py runs it",
    "bash scripts/test": "the test command itself: CI runs it (.ci/run)",
    "pip install 'outbox-router[django]'    # the app; router serve and init-db on PostgreSQL\n"
    "                                       # also need [postgresql], on MariaDB [mysql]": (
        "tests/e2e/test_sync_install.py installs the django extra in a fresh venv"
    ),
    "router init-db              # creates or upgrades router_outbox and its companions\n"
    "python manage.py migrate    # Django's own tables": (
        "tests/e2e/test_django_example.py runs both, in this order"
    ),
    QUICKSTART_COMMANDS: "test_quickstart_output here and tests/e2e/test_install.py run it",
    "$ router contract check          # after renaming OrderPlaced.customer to buyer\n"
    "contract check against contracts.lock.json: 1 breaking, 0 additive change(s)\n"
    "breaking  partners  order_placed v1  payload.customer: renamed to payload.buyer "
    "(removed, and added with its schema)": "tests/e2e/test_contract.py::"
    "test_renaming_a_field_of_a_published_event_fails_the_check",
    "$ router contract check          # after renaming the stream PARTNERS to PARTNERS_V2\n"
    "contract check against contracts.lock.json: 1 breaking, 0 additive change(s)\n"
    "breaking  partners  every event  binding.stream: changed: PARTNERS -> PARTNERS_V2; a "
    "partner bound to the old one receives nothing more": "tests/e2e/test_contract.py::"
    "test_renaming_the_stream_a_partner_consumes_fails_the_check",
    "$ router contract check          # after setting persistent: false on the warehouse broker\n"
    "contract check against contracts.lock.json: 1 breaking, 0 additive change(s)\n"
    "breaking  warehouse  every event  binding.persistent: changed: True -> False; messages "
    "are no longer stored on disk: a broker restart loses those not yet consumed": "tests/e2e/"
    "test_contract.py::test_turning_off_persistent_or_mandatory_fails_the_check",
    # The web app examples' commands (their pages and READMEs): run on PostgreSQL and NATS.
    FLASK_COMMANDS: "tests/e2e/test_flask_example.py (the app through Flask's test client)",
    FASTAPI_COMMANDS: "tests/e2e/test_fastapi_example.py (the app through TestClient)",
}
pytestmark = pytest.mark.timeout(120)


@dataclass
class Sample:
    """One marked block of a page."""

    page: str
    setup: str
    line: int
    commands: list[tuple[str, list[str]]] = field(default_factory=list)
    output: list[str] = field(default_factory=list)  # a block without `$` lines

    @property
    def where(self) -> str:
        """``page:line``, the sample's test id."""
        return f"{self.page}:{self.line}"


def sample_of(block: Block) -> Sample:
    """The commands and expected lines of a marked block."""
    assert block.setup is not None
    sample = Sample(block.page, block.setup, block.line)
    for raw in block.text.splitlines():
        if raw.startswith("$ "):
            sample.commands.append((raw[2:], []))
        elif sample.commands:
            sample.commands[-1][1].append(raw)
        else:
            sample.output.append(raw)
    for _, expected in sample.commands:
        while expected and not expected[-1].strip():  # the blank line before the next `$`
            expected.pop()
    return sample


BLOCKS = every_block()
SAMPLES = [sample_of(block) for block in BLOCKS if block.setup is not None]


def of(setup: str) -> list[object]:
    """The samples with this setup, one test parameter each."""
    return [pytest.param(s, id=s.where) for s in SAMPLES if s.setup == setup]


def test_the_docs_mark_their_samples() -> None:
    setups = {s.setup for s in SAMPLES}
    assert setups <= set(SETUPS), f"unknown readme-test setup(s): {setups - set(SETUPS)}"
    assert setups == set(SETUPS), f"no sample on any page with setup(s) {set(SETUPS) - setups}"
    for sample in SAMPLES:
        assert sample.commands or sample.setup == QUICKSTART, sample
        assert all(expected for _, expected in sample.commands), (
            f"a command without output: {sample}"
        )


@pytest.mark.parametrize(
    "block", [pytest.param(b, id=f"{b.page}:{b.line}") for b in BLOCKS if b.is_shell]
)
def test_every_shell_block_is_run(block: Block) -> None:
    """A shell block is a sample, or listed with the test that proves it."""
    assert block.setup is not None or block.text.strip() in PROVEN_ELSEWHERE, (
        f"{block.page}:{block.line}: a shell block nothing runs. Make it a sample "
        "(<!-- readme-test: SETUP --> above it, `$ ` before each command), or add it to "
        f"PROVEN_ELSEWHERE with the test that runs it:\n{block.text}"
    )


def test_every_block_proven_elsewhere_is_still_on_a_page() -> None:
    texts = {block.text.strip() for block in BLOCKS}
    stale = [text for text in PROVEN_ELSEWHERE if text not in texts]
    assert not stale, f"PROVEN_ELSEWHERE lists blocks no page has: {stale}"


def test_the_readme_quickstart_is_the_one_run() -> None:
    found = re.search(r"^## Quickstart\n.*?^```bash\n(.*?)^```", README.read_text(), re.M | re.S)
    assert found, "README.md has no Quickstart commands"
    assert found[1].strip() == QUICKSTART_COMMANDS


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
        """Run one sample command line here; its stdout (or stderr when stdout is empty)."""
        words = shlex.split(command)
        done: subprocess.CompletedProcess[str]
        if words[0] == "router":
            done = router(*words[1:], cwd=self.folder, env=self.env, timeout=30)
        elif words[0] == ".venv/bin/python":
            done = python(*words[1:], cwd=self.folder, env=self.env, timeout=30)
        else:
            pytest.fail(f"sample command not understood: {command}")
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
    """``actual`` is ``expected``, where a sample's ``…`` and ``{...}`` shorten it."""
    if "…" not in expected and "{...}" not in expected:
        return expected == actual
    pattern = re.escape(expected).replace("…", '[^"]*').replace(r"\{\.\.\.\}", r"\{[^{}]*\}")
    return re.fullmatch(pattern, actual) is not None


def compare(copy: Copy, command: str, expected: list[str], attempts: int = 1) -> None:
    """The real output of ``command`` starts with the sample's lines (tried a few times when
    the state the sample shows may be passing through a transition)."""
    want = [normalise_line(line) for line in expected]
    for attempt in range(attempts):
        got = copy.normalise(copy.run(command))
        if len(got) >= len(want) and all(map(matches, want, got)):
            return
        if attempt + 1 < attempts:
            time.sleep(0.5)
    diff = "\n".join(
        f"{'  ' if i < len(got) and matches(w, got[i]) else '! '}sample: {w}\n"
        f"  real:   {got[i] if i < len(got) else '<missing>'}"
        for i, w in enumerate(want)
    )
    pytest.fail(f"sample `$ {command}` is not the real output:\n{diff}")


@pytest.fixture
def copy(tmp_path: Path) -> Copy:
    return Copy(tmp_path)


@pytest.mark.parametrize("sample", of(FRESH))
def test_fresh_sample(copy: Copy, sample: Sample) -> None:
    for command, expected in sample.commands:
        compare(copy, command, expected)


@pytest.mark.parametrize("sample", of(INIT_DB))
def test_sample_after_init_db(copy: Copy, sample: Sample) -> None:
    assert copy.run("router init-db")
    for command, expected in sample.commands:
        compare(copy, command, expected)


@contextmanager
def serving(folder: Path, partner_down: bool) -> Iterator[Copy]:
    """A copy after init-db with ``router serve`` running in it."""
    copy = Copy(folder, partner_down=partner_down)
    assert copy.run("router init-db")
    serve = Serving(folder, copy.env)
    try:
        serve.wait_for("router.started")
        yield copy
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


@pytest.fixture(scope="module")
def partner_down(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Copy, str]]:
    """Serving with the partner broker down, after the example's 3 orders (shared: the
    samples only read); with a partner row's message id."""
    with serving(tmp_path_factory.mktemp("partner-down"), partner_down=True) as copy:
        copy.run(".venv/bin/python examples/shop/app.py")

        def settled() -> bool:
            targets = status_of(copy)
            partners = targets["partners"]
            return bool(
                targets["events"]["published"] == 6
                and partners["pending"] == 3
                and partners["circuit"] == "open"
            )

        wait_for(settled, "6 events published and 3 partner rows waiting, its circuit open")
        with sqlite3.connect(copy.folder / "var/shop.db") as db:
            (message_id,) = db.execute(
                "SELECT message_id FROM router_outbox WHERE target = 'partners' LIMIT 1"
            ).fetchone()
        yield copy, message_id


@pytest.mark.parametrize("sample", of(PARTNER_DOWN))
def test_operations_sample_with_the_partner_down(
    partner_down: tuple[Copy, str], sample: Sample
) -> None:
    copy, message_id = partner_down
    for command, expected in sample.commands:
        command = re.sub(UUID, message_id, command)
        compare(copy, command, expected, attempts=6)


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """What the Quickstart's listen.py printed once app.py's 9 messages were delivered."""
    with serving(tmp_path_factory.mktemp("quickstart"), partner_down=False) as copy:
        app, listen = (line.split("#")[0].strip() for line in QUICKSTART_COMMANDS.splitlines())
        copy.run(app)
        wait_for(
            lambda: (
                status_of(copy)["partners"]["published"] == 3
                and status_of(copy)["events"]["published"] == 6
            ),
            "the Quickstart's 9 messages delivered",
        )
        return copy.normalise(copy.run(listen))


@pytest.mark.parametrize("sample", of(QUICKSTART))
def test_quickstart_output(quickstart: list[str], sample: Sample) -> None:
    got = quickstart
    want = [normalise_line(line) for line in sample.output]
    heads = [i for i, line in enumerate(want) if line.startswith("[")]
    tail = [line for line in (want[heads[-1] + 2 :] if heads else want) if line != "…"]
    assert got[-len(tail) :] == tail, f"{sample.where}: {tail}\nreal: {got[-len(tail) :]}"
    pairs = [(got[i], got[i + 1]) for i, line in enumerate(got) if line.startswith("[")]
    for i in heads:
        found = [p for p in pairs if matches(want[i], p[0]) and matches(want[i + 1], p[1])]
        assert found, (
            f"{sample.where}: no real message like\n{want[i]}\n{want[i + 1]}"
            "\nreal:\n" + "\n".join(f"{h}\n{b}" for h, b in pairs)
        )
        pairs.remove(found[0])
