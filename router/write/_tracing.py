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
    found = _opentelemetry()
    if found is None:
        return None
    inject, current_span, current_context = found
    # Nothing set in the context (no span, no baggage), most calls: one look at it.
    if not current_context():
        return None
    # No span, or one that is not recording a trace: the W3C propagator writes nothing then,
    # and asking it costs every propagator of the global composite (a few us a stage()).
    if not current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier.get("traceparent")


@functools.cache
def _opentelemetry() -> (
    tuple[Callable[[dict[str, str]], Any], Callable[[], Any], Callable[[], Any]] | None
):
    """OpenTelemetry's ``inject``, ``get_current_span`` and ``get_current`` (the context),
    or None without it: looked up once, as an import that fails is searched for again on
    every try (a stage() would pay it per call)."""
    try:
        from opentelemetry.context import get_current
        from opentelemetry.propagate import inject
        from opentelemetry.trace import get_current_span
    except ImportError:
        return None
    return inject, get_current_span, get_current
