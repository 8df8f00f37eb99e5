"""Each package's public names are exactly its ``__all__`` (as httpx checks its own), and
importing ``envelopes`` and ``brokers`` loads nothing of ``router`` at run time (the import
contracts themselves are import-linter's: tests/unit/test_layers.py)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["router", "brokers", "envelopes"]
INCLUDED_PRIVATE_MEMBERS = {"__version__"}


@pytest.mark.parametrize("package", PACKAGES)
def test_all_lists_every_public_member_and_only_members_that_exist(package: str) -> None:
    module = importlib.import_module(package)
    for name in module.__all__:  # a package that imports its names on first use (router)
        getattr(module, name, None)
    public = {
        name
        for name, value in vars(module).items()
        if (not name.startswith("_") or name in INCLUDED_PRIVATE_MEMBERS)
        # submodules become attributes when imported; they are not re-exported names
        and not isinstance(value, types.ModuleType)
    }
    exported = list(module.__all__)
    assert sorted(public) == sorted(exported)
    assert len(set(exported)) == len(exported), "__all__ lists a name twice"
    assert [name for name in exported if not hasattr(module, name)] == []


def test_importing_every_envelopes_and_brokers_module_loads_nothing_from_router() -> None:
    script = """
import importlib, pkgutil, sys
import brokers, envelopes
for package in (envelopes, brokers):
    for found in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(found.name)
print(sorted(m for m in sys.modules if m == "router" or m.startswith("router.")))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_router_root_holds_at_most_ten_modules() -> None:
    modules = sorted(p.name for p in (ROOT / "router").glob("*.py"))
    assert len(modules) <= 10, modules
