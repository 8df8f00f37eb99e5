"""Argument types the commands share: counts, moments, instance names, NAME=VALUE pairs."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from envelopes import ConfigError

__all__ = ["instance", "moment", "pairs", "positive", "whole"]


def positive(text: str) -> int:
    """An integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def whole(text: str) -> int:
    """An integer of at least 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must be at least 0")
    return value


def instance(text: str) -> str:
    """A router's name, as worker ids and lease holders carry it."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", text):
        raise argparse.ArgumentTypeError(
            "up to 63 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return text


def moment(text: str) -> datetime:
    """ISO 8601, or a duration ago: 30m, 2h, 1d, 1w."""
    units = {"m": 60, "h": 3600, "d": 86400, "w": 604800}
    value = text.strip()
    if value and value[-1] in units and value[:-1].isdigit():
        return datetime.now(UTC) - timedelta(seconds=int(value[:-1]) * units[value[-1]])
    try:
        found = datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use ISO 8601 or 30m, 2h, 1d, 1w") from None
    return found if found.tzinfo else found.replace(tzinfo=UTC)


def pairs(items: Sequence[str], option: str) -> dict[str, str]:
    """``NAME=VALUE`` options (``--header``, ``--extension``) as a mapping."""
    found = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ConfigError(f"{option} takes NAME=VALUE, got {item!r}")
        found[name] = value
    return found
