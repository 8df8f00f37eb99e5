"""The W3C ``traceparent`` of the code that stages an event, when OpenTelemetry is in use.

OpenTelemetry is optional: without it (or without an active span) there is no traceparent
unless the caller passes one to ``stage()``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["current_traceparent"]


def current_traceparent() -> str | None:
    """The active span's traceparent from OpenTelemetry's context, if any."""
    inject = _inject()
    if inject is None:
        return None
    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier.get("traceparent")


@functools.cache
def _inject() -> Callable[[dict[str, str]], Any] | None:
    """OpenTelemetry's ``inject``, or None without it: looked up once, as an import that
    fails is searched for again on every try (a stage() would pay it per call)."""
    try:
        from opentelemetry.propagate import inject
    except ImportError:
        return None
    return inject
