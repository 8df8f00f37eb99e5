"""What the docs site promises on its landing pages, and how it shows code: the home page's
"what works with what" names the sync paths too, the frameworks page links every framework's
page, and long code lines wrap instead of being cut off at the page's edge."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def section(page: str, heading: str) -> str:
    """The text of ``page`` under ``## heading``, up to the next heading of that level."""
    text = (DOCS / page).read_text()
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def test_the_home_page_names_the_sync_connections_and_frameworks() -> None:
    table = section("index.md", "What works with what")
    sync = [line for line in table.splitlines() if "`SyncOutbox`" in line]
    assert len(sync) == 1, table
    for name in ("SQLAlchemy `Session`", "psycopg 3", "psycopg2", "sqlite3", "PyMySQL"):
        assert name in sync[0], name
    frameworks = [line for line in table.splitlines() if line.startswith("| frameworks")]
    assert len(frameworks) == 1, table
    for page in ("frameworks-django.md", "frameworks-flask.md", "frameworks-fastapi.md"):
        assert f"]({page})" in frameworks[0], page


def test_the_frameworks_page_links_every_framework_page() -> None:
    text = (DOCS / "frameworks.md").read_text()
    pages = sorted(path.name for path in DOCS.glob("frameworks-*.md"))
    assert pages == ["frameworks-django.md", "frameworks-fastapi.md", "frameworks-flask.md"]
    assert [page for page in pages if f"]({page})" not in text] == []


def test_code_blocks_wrap_long_lines_on_the_site() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    sheets = config.get("extra_css", [])
    rules = "".join((DOCS / sheet).read_text() for sheet in sheets)
    found = re.search(r"\.md-typeset pre > code\s*\{([^}]*)\}", rules)
    assert found is not None, f"no rule for code blocks in {sheets}"
    assert re.search(r"white-space:\s*pre-wrap", found.group(1))


def test_the_api_reference_covers_the_public_api() -> None:
    """docs/reference/api.md documents each name where it is defined (mkdocstrings reads the
    source statically, not ``router``'s lazy re-exports), and all of the Django integration."""
    import router
    import router.contrib.django

    text = (DOCS / "reference" / "api.md").read_text()
    documented = []
    for path in re.findall(r"^::: ([\w.]+)$", text, re.M):
        module, _, name = path.rpartition(".")
        documented.append(getattr(importlib.import_module(module), name))
    names = ["Event", "RaisesEvents", "Outbox", "Transaction", "SyncOutbox", "Inbox"]
    names += ["inbox_middleware", "message_id_of"]
    missing = [name for name in names if getattr(router, name) not in documented]
    assert missing == [], f"docs/reference/api.md does not document {missing}"
    assert router.contrib.django in documented
    members = re.findall(r"^        - (\w+)$", text, re.M)
    assert sorted(members) == sorted(router.contrib.django.__all__)
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert {"Python API": "reference/api.md"} in config["nav"][-1]["Reference"]
