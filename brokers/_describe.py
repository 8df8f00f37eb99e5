"""How adapters put a client library's exception into an error message."""

from __future__ import annotations

__all__ = ["describe"]


def describe(exc: BaseException) -> str:
    """``Type: first line of the message`` (the type alone when the message says nothing)."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    name = type(exc).__name__
    return f"{name}: {first}" if first and first != name else name
