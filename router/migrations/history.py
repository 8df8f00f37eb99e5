"""What an earlier revision installed, for the revisions that change its text or put it back.

A revision is history: once released, its text never changes. So a later revision that
rewrites a function reads the earlier text from that revision's module (and applies its
change to it, or installs it again on downgrade) rather than copying it. The modules live in
``versions/`` beside this one, which is no package: each is loaded from its file.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

__all__ = ["earlier"]

_VERSIONS = Path(__file__).with_name("versions")


def earlier(filename: str) -> ModuleType:
    """The module of the revision in ``versions/filename`` (``0017_held_and_parked.py``)."""
    spec = importlib.util.spec_from_file_location(
        f"router_migration_{filename[:4]}", _VERSIONS / filename
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
