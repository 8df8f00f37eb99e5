"""The names of the router's database objects are written in ``router/_schema.py`` alone: no
other string of the code (``router/``, ``brokers/``, ``envelopes/``) spells one, so renaming an
object is a migration and one change there. The migrations keep their own literals: each is
the schema as it was at its revision.

Documentation may name the objects: docstrings and comments (which ``ast`` never sees), and any
other string standing alone as a statement (the docstrings of module attributes). Any other
string constant, an f-string's text included, fails with its file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

from router import _schema

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("router", "brokers", "envelopes")
EXEMPT = ("router/_schema.py", "router/migrations/")

# Every name the schema module holds. The partitions, the sequence and the outbox's indexes
# all contain the outbox's own name, so a string spelling any of them is caught by that one.
NAMES = tuple(
    sorted(
        value
        for value in (getattr(_schema, name) for name in _schema.__all__)
        if isinstance(value, str)
    )
)


def documentation(tree: ast.AST) -> set[int]:
    """The ids of the string constants that stand alone as statements: docstrings."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }


def spelled_names(source: str, path: str) -> list[str]:
    """``path:line: 'text'`` for each string constant of ``source`` (an f-string by its
    literal text) that contains a name of ``NAMES`` and is not documentation."""
    tree = ast.parse(source, path)
    skipped = documentation(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            # Its parts are walked too; they are read here, as the f-string's text.
            parts = [part for part in node.values if isinstance(part, ast.Constant)]
            skipped.update(id(part) for part in parts)
            text = "".join(str(part.value) for part in parts)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) in skipped:
                continue
            text = node.value
        else:
            continue
        if any(name in text for name in NAMES):
            found.append(f"{path}:{node.lineno}: {text.strip()[:80]!r}")
    return found


def code_files() -> list[Path]:
    """Every module of the three packages but the schema module and the migrations."""
    files = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if not relative.startswith(EXEMPT):
                files.append(path)
    return files


def test_no_module_spells_a_schema_name() -> None:
    found = [
        spelled
        for path in code_files()
        for spelled in spelled_names(path.read_text(), path.relative_to(ROOT).as_posix())
    ]
    assert found == [], "name these through router._schema:\n" + "\n".join(found)


def test_the_check_finds_a_spelled_name_and_passes_documentation() -> None:
    source = '''
"""The module's docstring may name router_outbox."""
from router._schema import OUTBOX

LIMIT = 3
"""An attribute's docstring may name router_streams too."""

# A comment may name router_targets.
PLAIN = "DELETE FROM router_outbox_done WHERE seq = %s"
FORMATTED = f"SELECT count(*) FROM router_targets LIMIT {LIMIT}"
NAMED = f"SELECT count(*) FROM {OUTBOX}"


def claim() -> str:
    """A function's docstring may name ix_router_outbox_claim."""
    return "SELECT * FROM " "router_claim($1)"
'''
    assert {"router_outbox", "router_streams", "router_targets"} <= set(NAMES)
    assert spelled_names(source, "example.py") == [
        "example.py:9: 'DELETE FROM router_outbox_done WHERE seq = %s'",
        "example.py:10: 'SELECT count(*) FROM router_targets LIMIT'",
        "example.py:16: 'SELECT * FROM router_claim($1)'",
    ]
