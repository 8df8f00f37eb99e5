"""Imports flow one way and in no circle, checked by import-linter's contracts in
pyproject.toml (``[tool.importlinter]``), which read every import statement, those inside
functions too; and no module imports another module's private names, which import-linter
cannot see (it works on modules, not names).

The contracts are run twice: on the code as it is (all kept), and on a copy broken on
purpose (each broken contract named), so a contract that could never fail is caught too.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("router", "brokers", "envelopes")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

LAYERS = "inside router: root <- write, relay <- ops <- serve, contrib <- cli"
PACKAGE_FLOW = "envelopes <- brokers <- router"
ROOT_MODULES = "router's root modules import no layer above them"
PRIVATE_MODULES = "a private module is imported only inside its own package"
NO_CYCLE = "no import cycle"
NEUTRAL = "router names no broker kind: it imports brokers only through the package root"


def lint_imports(folder: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the packages in ``folder``, with the project's contracts."""
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", str(ROOT / "pyproject.toml")],
        cwd=folder,
        env={"PYTHONPATH": str(folder), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def contract_lines(output: str) -> dict[str, str]:
    """``{contract name: "KEPT" | "BROKEN"}`` from lint-imports' report."""
    found = {}
    for line in output.splitlines():
        for verdict in ("KEPT", "BROKEN"):
            if f" {verdict}" in line:
                found[line.split(f" {verdict}")[0].strip()] = verdict
    return found


def test_every_import_contract_is_kept() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    verdicts = contract_lines(result.stdout)
    assert verdicts == dict.fromkeys(
        [PACKAGE_FLOW, LAYERS, ROOT_MODULES, NEUTRAL, PRIVATE_MODULES, NO_CYCLE], "KEPT"
    )


def broken_copy(tmp_path: Path, edits: dict[str, str]) -> Path:
    """The three packages copied to ``tmp_path``, with ``edits`` appended to the modules."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("*.pyc"))
    for module, line in edits.items():
        path = tmp_path / module
        path.write_text(path.read_text() + f"\n{line}\n")
    return tmp_path


@pytest.mark.parametrize(
    ("edits", "broken"),
    [
        # ops reaching up to the CLI, inside a function as the lazy imports are written
        ({"router/ops/status.py": "def _f():\n    import router.cli.output"}, {LAYERS, NO_CYCLE}),
        ({"router/write/outbox.py": "import router.relay.retry"}, {LAYERS}),
        # the root importing ops: write and relay, which import the root, now reach ops too
        ({"router/config.py": "import router.ops.connections"}, {ROOT_MODULES, LAYERS, NO_CYCLE}),
        ({"brokers/memory.py": "import router.config"}, {PACKAGE_FLOW}),
        (
            {"router/ops/status.py": "import router.relay.store.base\nimport brokers.nats._acks"},
            {PRIVATE_MODULES, NEUTRAL},
        ),
        # the core telling a kind by its settings class, from the union's module or its own
        ({"router/serve/check.py": "from brokers.settings import NatsSettings"}, {NEUTRAL}),
        ({"router/ops/preview.py": "from brokers.kafka import KafkaSettings"}, {NEUTRAL}),
        ({"router/ops/flow.py": "import router.ops.status"}, {NO_CYCLE}),  # status imports flow
        # serve and contrib are independent: neither may import the other
        ({"router/serve/runner.py": "import router.contrib.django"}, {LAYERS}),
    ],
    ids=[
        "up-a-layer",
        "write-to-relay",
        "root-to-ops",
        "brokers-to-router",
        "private",
        "kind-from-union",
        "kind-from-its-package",
        "cycle",
        "serve-to-contrib",
    ],
)
def test_a_broken_rule_breaks_its_contract(
    tmp_path: Path, edits: dict[str, str], broken: set[str]
) -> None:
    result = lint_imports(broken_copy(tmp_path, edits))
    assert result.returncode == 1, result.stdout + result.stderr
    verdicts = contract_lines(result.stdout)
    assert {name for name, verdict in verdicts.items() if verdict == "BROKEN"} == broken


def test_the_brokers_root_exports_no_kinds_settings_class() -> None:
    """What keeps the kind-neutral contract meaningful: import-linter cannot see names, so
    the one module router may import from must not hand out a kind's settings class."""
    import brokers

    exported = [getattr(brokers, name) for name in brokers.__all__]
    kinds = [
        value
        for value in exported
        if isinstance(value, type)
        and issubclass(value, brokers.BrokerSettings)
        and value is not brokers.BrokerSettings
    ]
    assert kinds == []


def private_name_imports(path: Path, module: str) -> list[str]:
    """``from X import _name`` in ``path`` where ``_name`` is another module's private name
    (a private *module* of a package is import-linter's to judge)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom) or node.level or node.module is None:
            continue
        for alias in node.names:
            name = alias.name
            private = name.startswith("_") and not name.startswith("__")
            is_module = (ROOT / node.module.replace(".", "/") / name).with_suffix(".py").exists()
            if private and not is_module and node.module != module:
                found.append(f"{module}:{node.lineno}: from {node.module} import {name}")
    return found


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_module_imports_another_modules_private_names() -> None:
    files = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    assert len(files) > 100
    found = [hit for p in files for hit in private_name_imports(p, module_name(p))]
    assert found == []


def test_the_private_name_check_sees_one(tmp_path: Path) -> None:
    path = ROOT / "router/ops/status.py"
    copy = tmp_path / "status.py"
    copy.write_text(path.read_text() + "\nfrom router.ops.outbox import _upsert_target\n")
    assert private_name_imports(copy, "router.ops.status") == [
        "router.ops.status:"
        f"{copy.read_text().count(chr(10))}: from router.ops.outbox import _upsert_target"
    ]
