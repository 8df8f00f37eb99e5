"""Every ```python and ```yaml block of README.md and of every docs page is checked, so a
renamed class, keyword or config key fails here and not in a reader's hands.

A Python block is compiled (top-level ``await`` allowed, as in an async function's body) and
every import it makes must resolve. Then it is run, in a fresh namespace in a temp folder
holding the shipped config.yaml, unless it is listed:

- ``EXCERPTS``: a shortened excerpt of an example's code; each line of it must be a line of
  that file (comments, blank lines and ``...`` aside), and the example's own test runs it;
- ``NOT_RUN``: running it needs a database or a broker (its ``session``, ``conn`` or
  ``engine`` is the reader's), so it is only compiled and its imports resolved.

A block listed in ``CONTINUES`` runs in a copy of what the block it continues left behind.

A YAML block is parsed, merged into ``BASE`` (a minimal config) and loaded with the
project's loader (``parse_config``: ``${VAR}`` from ``ENV``, then ``RouterConfig``, whose
models refuse unknown keys), with config deprecation warnings as errors. A block that is a
fragment of a section (not a whole config) goes where ``FRAGMENTS`` says; a YAML block that
is no config at all must be in ``NOT_CONFIG`` with why. An unlisted block that fails its
check fails here; a listed block no page holds any more fails too.
"""

from __future__ import annotations

import ast
import copy
import importlib
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml

import router.write.events
from router import RouterConfig
from router._yaml import parse_config
from tests.docs_blocks import ROOT, Block, every_block

BLOCKS = every_block()
PYTHON = [block for block in BLOCKS if block.language == "python"]
YAML = [block for block in BLOCKS if block.language == "yaml"]

FLASK_APP = "examples/flask_shop/app.py"
FASTAPI_APP = "examples/fastapi_shop/app.py"
# Excerpts, with the file whose lines they are; the test that runs that file's code.
EXCERPTS = {
    "docs/frameworks-flask.md: def create_app() -> Flask:": FLASK_APP,
    'docs/frameworks-flask.md: @orders.post("/orders")': FLASK_APP,
    "docs/frameworks-flask.md: class Order(Base, RaisesEvents):": FLASK_APP,
    # tests/e2e/test_flask_example.py runs the Flask app, tests/e2e/test_fastapi_example.py
    # the FastAPI one, tests/e2e/test_django_example.py the Django shop's `manage.py test`.
    "docs/frameworks-fastapi.md: def open_shop() -> Shop:": FASTAPI_APP,
    "docs/frameworks-fastapi.md: async def transaction(shop: Annotated[Shop, Depends(get_shop)])"
    " -> AsyncIterator[AsyncSession]:": FASTAPI_APP,
    'docs/frameworks-fastapi.md: @orders.post("/orders", status_code=201)': FASTAPI_APP,
    'docs/frameworks-fastapi.md: @orders.post("/orders/{order_id}/pay")': FASTAPI_APP,
    "docs/frameworks-django.md: # orders/tests.py (examples/django_shop)": (
        "examples/django_shop/orders/tests.py"
    ),
}
# Compiled and imports resolved, not run: what running them needs.
NOT_RUN = {
    "README.md: from decimal import Decimal": "stages in the reader's AsyncSession: a database",
    "docs/frameworks-django.md: # a view, a management command, a Celery task": (
        "a configured Django project and its database (examples/django_shop does this)"
    ),
    "docs/frameworks-django.md: from router.contrib.django import RaisesEventsOnSave": (
        "a Django model, so a configured Django project and its database"
    ),
    "docs/frameworks.md: from router import SyncOutbox": "a SQLAlchemy Session on a database",
    "docs/frameworks.md: with psycopg.connect(url) as conn:"
    "                      # commits when the block ends": "a PostgreSQL server",
    "docs/frameworks.md: from router import RaisesEvents": "a mapped entity and its database",
    "docs/frameworks.md: async with session.begin():": "an AsyncSession on a database",
    "docs/frameworks.md: async with engine.begin() as conn:": "an AsyncEngine on a database",
    "docs/frameworks.md: async with conn.transaction():": "an asyncpg connection: PostgreSQL",
    "docs/frameworks.md: async with outbox.transaction() as tx:"
    '          # or outbox.transaction("billing")': "the config's database, migrated",
    "docs/tutorial.md: # In your own transaction: SQLAlchemy AsyncSession ...": (
        "an AsyncSession and a connection on a database"
    ),
    "docs/tutorial.md: await outbox.stage(session, *events, stream_keys=[e.order_id for e in "
    "events])": "an AsyncSession on a database",
    "docs/tutorial.md: from azure.servicebus.aio import ServiceBusClient": (
        "an Azure Service Bus namespace and the reader's database"
    ),
}
# A block that builds on the one before it on its page: the block it continues.
CONTINUES = {
    "docs/tutorial.md: # Kafka (key = stream key, so one order's events come in order on one "
    "partition)": "docs/tutorial.md: from faststream import AckPolicy, Context, FastStream",
}

# The smallest config the fragments are merged into: an internal broker and a partner.
BASE: dict[str, Any] = {
    "service": "docs",
    "databases": {"main": "sqlite:///./var/docs.db"},
    "brokers": {
        "events": {
            "type": "nats",
            "internal": True,
            "url": "nats://127.0.0.1:4222",
            "stream": {"name": "SHOP", "subjects": ["shop.>"]},
        },
        "partners": {
            "type": "nats",
            "url": "nats://127.0.0.1:4222",
            "stream": {"name": "PARTNERS", "subjects": ["partners.>"]},
        },
    },
}
# The variables the docs' configs read without a default.
ENV = {
    "BILLING_DB_PASSWORD": "secret",
    "DB_PASSWORD": "secret",
    "PARTNER_NATS_URL": "nats://partner:4222",
    "KAFKA_PASSWORD": "secret",
    "RABBIT_PASSWORD": "secret",
    "REDIS_PASSWORD": "secret",
    "SERVICEBUS_CONNECTION_STRING": (
        "Endpoint=sb://shop.servicebus.windows.net/;SharedAccessKeyName=send;SharedAccessKey=k"
    ),
    "ROUTER_HTTP_TOKEN": "token",
}
# A block that is part of one section, with where in a config it goes.
FRAGMENTS = {
    "docs/partners.md: expose:": ("brokers", "partners"),  # a partner broker's allow-list
}
# YAML blocks that are not a router config, with what they are.
NOT_CONFIG: dict[str, str] = {}


def param(block: Block) -> Any:
    """One test parameter per block, named by page and line."""
    return pytest.param(block, id=f"{block.page}:{block.line}")


def by_key(key: str) -> Block:
    """The one block with this key."""
    (found,) = [block for block in BLOCKS if block.key == key]
    return found


def resolve_imports(tree: ast.AST) -> None:
    """Import every module the code imports, and find every name it imports from one."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            module = importlib.import_module(node.module)
            for alias in node.names:
                if alias.name != "*" and not hasattr(module, alias.name):
                    # a submodule is importable without being an attribute yet
                    importlib.import_module(f"{node.module}.{alias.name}")


def compiled(block: Block) -> ast.Module:
    """The block's syntax tree, its imports resolved."""
    tree = ast.parse(block.text, filename=block.key)
    code = compile(tree, block.key, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    assert code is not None
    resolve_imports(tree)
    return tree


def run(block: Block) -> dict[str, Any]:
    """Run the block in a fresh namespace (or a copy of what the block it continues left)."""
    before = CONTINUES.get(block.key)
    namespace = dict(run(by_key(before))) if before else {"__name__": "docs_block"}
    exec(compile(block.text, block.key, "exec"), namespace)
    return namespace


def code_lines(text: str) -> list[str]:
    """The lines of code, stripped, without trailing comments; comment lines, blank lines
    and ``...`` left out."""
    found = []
    for line in text.splitlines():
        code = line.split("  #", 1)[0].strip()
        if code and code != "..." and not code.startswith("#"):
            found.append(code)
    return found


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A temp folder with the shipped config.yaml, and the event registry restored after:
    the docs declare ``OrderPlaced`` and friends, which must not shadow other tests'."""
    shutil.copy(ROOT / "config.yaml", tmp_path / "config.yaml")
    monkeypatch.chdir(tmp_path)
    for name in ("_CLASSES", "_DOWNCASTERS"):
        monkeypatch.setattr(
            router.write.events, name, copy.deepcopy(vars(router.write.events)[name])
        )


@pytest.mark.usefixtures("isolated")
# FastStream's advice on a durable push consumer, which the tutorial's NATS handler is.
@pytest.mark.filterwarnings("ignore:The JetStream Push consumer")
@pytest.mark.parametrize("block", [param(b) for b in PYTHON])
def test_every_python_block_runs_or_is_checked(block: Block) -> None:
    compiled(block)
    if block.key in EXCERPTS:
        source = (ROOT / EXCERPTS[block.key]).read_text(encoding="utf-8")
        have = set(code_lines(source))
        foreign = [line for line in code_lines(block.text) if line not in have]
        assert foreign == [], f"{block.key}: lines {EXCERPTS[block.key]} does not have"
    elif block.key not in NOT_RUN:
        try:
            run(block)
        except Exception as exc:
            pytest.fail(
                f"{block.key}: {exc!r} when run. Fix the block; if running it needs a database "
                "or a broker, list it in NOT_RUN with what it needs"
            )


def test_every_listed_python_block_is_on_a_page() -> None:
    keys = [block.key for block in PYTHON]
    assert len(keys) == len(set(keys)), "two Python blocks of one page start alike"
    listed = [*EXCERPTS, *NOT_RUN, *CONTINUES, *CONTINUES.values()]
    assert [key for key in listed if key not in keys] == [], "listed blocks no page has"
    assert not set(EXCERPTS) & set(NOT_RUN), "a block is either an excerpt or not run"


def merged(base: Any, fragment: Any) -> Any:
    """``fragment`` laid over ``base``, mapping by mapping."""
    if not isinstance(base, dict) or not isinstance(fragment, dict):
        return copy.deepcopy(fragment)
    result = copy.deepcopy(base)
    for key, value in fragment.items():
        result[key] = merged(result.get(key), value)
    return result


@pytest.mark.filterwarnings("error::router.errors.ConfigDeprecationWarning")
@pytest.mark.parametrize("block", [param(b) for b in YAML])
def test_every_yaml_block_is_a_valid_config(block: Block) -> None:
    data = yaml.safe_load(block.text)
    if block.key in NOT_CONFIG:
        return
    for key in reversed(FRAGMENTS.get(block.key, ())):
        data = {key: data}
    assert isinstance(data, dict), f"{block.key}: not a mapping"
    unknown = set(data) - set(RouterConfig.model_fields)
    assert not unknown, (
        f"{block.key}: top-level keys {unknown} are no config section: a fragment goes in "
        "FRAGMENTS with where it belongs, anything else in NOT_CONFIG with why"
    )
    text = yaml.safe_dump(merged(BASE, data), sort_keys=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        parse_config(text, source=f"{block.page}:{block.line}", env=ENV)


def test_every_listed_yaml_block_is_on_a_page() -> None:
    keys = {block.key for block in YAML}
    assert [key for key in [*FRAGMENTS, *NOT_CONFIG] if key not in keys] == []


def test_the_base_config_is_valid_alone() -> None:
    parse_config(yaml.safe_dump(BASE), env={})
