"""Lazy adapters: a broker package exports its settings at once and its adapter on first use.

Importing ``brokers`` (or ``router``) must not import any broker SDK: a config names only some
broker kinds, and a plain ``pip install outbox-router`` carries only the NATS client. Each
broker package's ``__getattr__`` is made here; the adapter module, and with it the SDK, is
imported when the adapter class is first asked for.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

from envelopes import ConfigError

__all__ = ["MissingClient", "adapter_getattr", "import_adapter", "missing_modules"]


class MissingClient(ConfigError):
    """A configured broker kind's client library is not installed (names the extra)."""


def missing_modules(modules: tuple[str, ...]) -> list[str]:
    """The top-level modules of ``modules`` that cannot be found (nothing is imported)."""
    missing = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent package is missing or broken
            found = False
        if not found:
            missing.append(name)
    return missing


def import_adapter(path: str, *, kind: str, extra: str | None) -> Any:
    """Import ``module:Class``; a missing client library becomes ``MissingClient``."""
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise MissingClient(install_hint(kind, extra, exc.name)) from exc
    return getattr(module, attribute)


def install_hint(kind: str, extra: str | None, module: str | None = None) -> str:
    """What to run when ``kind``'s client library is missing."""
    what = f" ({module} is not installed)" if module else ""
    if extra is None:
        return f"the {kind} broker's client library cannot be imported{what}"
    return f"the {kind} broker needs its client library{what}: pip install 'outbox-router[{extra}]'"


def adapter_getattr(
    package: str, adapters: dict[str, str], *, kind: str, extra: str | None
) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``adapters[name]`` (``module:Class``) on demand."""

    def load(name: str) -> Any:
        path = adapters.get(name)
        if path is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return import_adapter(path, kind=kind, extra=extra)

    return load
