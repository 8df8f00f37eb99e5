"""Each package's public names are exactly its __all__; imports flow one way."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("package", ["router", "brokers", "envelopes"])
def test_all_lists_every_public_member_and_nothing_else(package: str) -> None:
    module = importlib.import_module(package)
    public = {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and getattr(value, "__module__", "").startswith(package)
        and not isinstance(value, type(module))
    }
    exported = set(module.__all__)
    assert public <= exported, public - exported
    assert all(hasattr(module, name) for name in exported)


@pytest.mark.parametrize(
    ("package", "forbidden"), [("envelopes", ("router", "brokers")), ("brokers", ("router",))]
)
def test_imports_flow_one_way(package: str, forbidden: tuple[str, ...]) -> None:
    pattern = re.compile(rf"^\s*(from|import)\s+({'|'.join(forbidden)})\b", re.MULTILINE)
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / package).rglob("*.py")
        if pattern.search(p.read_text())
    ]
    assert offenders == []
