"""docs/architecture.md's module map (the indented tree under "## The map") is the code's
layout: every module and package of ``router/`` is on it, and every name on it exists, so a
module added, moved or removed without the map fails here.

A map line is an entry (names, then two spaces or more, then what they are) or the
continuation of the entry above it (indented past the entry's children). An entry's names,
a file ``x.py`` or a package ``x/``, are separated by spaces or ", ", and sit two spaces
deeper than the package that holds them.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
NAME = re.compile(r"[\w.]+(\.py|/)")
# Alembic's revisions are named by number and added with every schema change; the map names
# their folder, and `router/migrations/versions/` is what a reader needs to find them.
REVISIONS = "router/migrations/versions/"


def map_text() -> str:
    """The fenced block under ``## The map``."""
    found = re.search(r"^## The map\n+```\n(.*?)^```", ARCHITECTURE.read_text(), re.M | re.S)
    assert found, "docs/architecture.md has no module map under '## The map'"
    return found[1]


def entry_names(text: str) -> list[str]:
    """Every path the map names (``router/write/sync.py``, ``router/write/``), in order."""
    names: list[str] = []
    parents: list[tuple[int, str]] = []  # (indent, path) of the packages above this line
    last_indent = -2
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        if indent > last_indent + 2:  # past any child's place: the description goes on
            continue
        head = re.split(r" {2,}", line.strip(), maxsplit=1)[0]
        tokens = [token for token in re.split(r",? ", head) if token]
        wrong = [token for token in tokens if not NAME.fullmatch(token)]
        assert not wrong, f"map line {number} is neither an entry nor a continuation: {line!r}"
        while parents and parents[-1][0] >= indent:
            parents.pop()
        assert parents or indent == 0, f"map line {number} has no package above it: {line!r}"
        base = parents[-1][1] if parents else ""
        names += [base + token for token in tokens]
        if len(tokens) == 1 and tokens[0].endswith("/"):
            parents.append((indent, base + tokens[0]))
        last_indent = indent
    return names


def router_modules() -> set[str]:
    """Every module and package of ``router/``, as the map names them (``__init__.py`` by
    its package)."""
    found: set[str] = set()
    for path in (ROOT / "router").rglob("*.py"):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith(REVISIONS):
            found.add(REVISIONS)
        elif path.name == "__init__.py":
            found.add(path.parent.relative_to(ROOT).as_posix() + "/")
        else:
            found.add(relative)
    return found


def test_the_map_names_every_module_of_router() -> None:
    missing = sorted(router_modules() - set(entry_names(map_text())))
    assert missing == [], f"docs/architecture.md's map does not name: {missing}"


def test_every_name_on_the_map_exists() -> None:
    gone = [name for name in entry_names(map_text()) if not (ROOT / name).exists()]
    assert gone == [], f"docs/architecture.md's map names what is not there: {gone}"


def test_the_map_is_read_as_a_tree() -> None:
    names = entry_names(map_text())
    assert len(names) == len(set(names)), "a name is on the map twice"
    for name in ("envelopes/", "brokers/nats/", "router/__init__.py", "router/relay/store/"):
        assert name in names, name
    assert "router/relay/store/postgres_wal.py" in names
    assert "router/ops/contract/_diff.py" in names
    assert "router/contrib/django/models.py" in names
