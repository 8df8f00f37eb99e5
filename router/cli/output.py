"""What the commands print and return: exit codes, ``--json`` or human text, aligned tables."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from router._secrets import Redactor

__all__ = ["EXIT_CONFIG", "EXIT_FAILED", "EXIT_OK", "emit", "table"]

EXIT_OK = 0
EXIT_FAILED = 1  # the command ran and something it checked or did failed
EXIT_CONFIG = 2  # it could not run: the config, the arguments or the schema are wrong


def emit(args: argparse.Namespace, document: Any, human: str, redactor: Redactor) -> None:
    """``human``, or with ``--json`` the document; either way with every secret masked (an
    error text may quote a URL with its password)."""
    print(redactor(json.dumps(document, indent=2, default=str) if args.json else human))


def table(header: Sequence[str], rows: Sequence[Sequence[object]], *, right: int = 0) -> str:
    """An aligned table; columns from index ``right`` on that hold numbers align right."""
    cells = [[str(c) for c in header]] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    numeric = [
        i >= right and all(_is_number(row[i]) for row in cells[1:]) and len(cells) > 1
        for i in range(len(header))
    ]
    lines = []
    for n, row in enumerate(cells):
        lines.append(
            "  ".join(
                cell.rjust(width) if numeric[i] and n > 0 else cell.ljust(width)
                for i, (cell, width) in enumerate(zip(row, widths, strict=True))
            ).rstrip()
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _is_number(text: str) -> bool:
    return text == "-" or text.replace(".", "", 1).replace("-", "", 1).isdigit()
