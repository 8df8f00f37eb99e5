"""Write the configuration and CLI references (docs/reference/) from the code.

    python scripts/reference.py          write both files
    python scripts/reference.py --check  exit 1, naming each stale file with a diff

The configuration reference walks the pydantic models of ``config.yaml``; the CLI reference
walks the ``router`` command's argparse parser. tests/unit/test_reference_docs.py fails when
a committed file differs from what this script writes.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from scripts._cli_reference import cli_markdown
from scripts._config_reference import configuration_markdown

__all__ = ["OUTPUTS", "ROOT", "diff", "main"]

ROOT = Path(__file__).resolve().parents[1]


def _cli_parser() -> argparse.ArgumentParser:
    """The ``router`` command's parser; the one place that knows where it is built."""
    from router.cli.parser import build_parser

    return build_parser()


@contextmanager
def _without_router_variables() -> Iterator[None]:
    """Hide ``ROUTER_*`` variables, which the parser reads for its defaults."""
    hidden = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith("ROUTER_")}
    try:
        yield
    finally:
        os.environ.update(hidden)


def _cli_reference() -> str:
    with _without_router_variables():
        parser = _cli_parser()
    return cli_markdown(parser)


# Each generated file, relative to the repository, and what writes it.
OUTPUTS: dict[str, Callable[[], str]] = {
    "docs/reference/configuration.md": configuration_markdown,
    "docs/reference/cli.md": _cli_reference,
}


def diff(relative: str, generated: str) -> str:
    """How the committed file differs from ``generated``, as a unified diff; "" if it does not."""
    path = ROOT / relative
    committed = path.read_text(encoding="utf-8") if path.exists() else ""
    if committed == generated:
        return ""
    return "".join(
        difflib.unified_diff(
            committed.splitlines(keepends=True),
            generated.splitlines(keepends=True),
            fromfile=f"{relative} (committed)",
            tofile=f"{relative} (generated)",
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Write the references, or with ``--check`` report the stale ones (exit 1)."""
    parser = argparse.ArgumentParser(
        prog="scripts/reference.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    generated = {relative: render() for relative, render in OUTPUTS.items()}
    if args.check:
        stale = {relative: diff(relative, text) for relative, text in generated.items()}
        stale = {relative: problem for relative, problem in stale.items() if problem}
        for relative, problem in stale.items():
            print(f"{relative} is stale:\n{problem}", file=sys.stderr)
        if stale:
            print("Run `python scripts/reference.py` and commit the result.", file=sys.stderr)
        return 1 if stale else 0
    for relative, text in generated.items():
        path = ROOT / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8", newline="\n")
        print(f"wrote {relative}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
