"""The W3C ``traceparent`` of the code that stages an event, when OpenTelemetry is in use.

OpenTelemetry is optional: without it (or without an active span) there is no traceparent
unless the caller passes one to ``stage()``.
"""

from __future__ import annotations

__all__ = ["current_traceparent"]


def current_traceparent() -> str | None:
    """The active span's traceparent from OpenTelemetry's context, if any."""
    try:
        from opentelemetry.propagate import inject
    except ImportError:
        return None
    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier.get("traceparent")
