"""The fenced blocks of README.md and of every docs page, for the tests that run or check
them: the shell samples (tests/e2e/test_readme.py) and the Python and YAML blocks
(tests/unit/test_docs_code.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SHELLS = {"bash", "sh", "shell", "console", "zsh"}
MARKER = re.compile(r"^<!-- readme-test: (.*?) -->$")
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def pages() -> list[Path]:
    """README.md and every page of the docs site."""
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


@dataclass(frozen=True)
class Block:
    """One fenced block of a page."""

    page: str  # relative to the repository
    line: int  # of the opening fence
    language: str
    text: str
    setup: str | None  # the readme-test marker right above it, if any

    @property
    def is_shell(self) -> bool:
        """A shell block, by its language or its ``$`` lines."""
        lines = self.text.splitlines()
        return self.language in SHELLS or any(line.startswith("$ ") for line in lines)

    @property
    def key(self) -> str:
        """``page: first line``: how the tests' lists name a block (its line number moves
        with every edit above it)."""
        return f"{self.page}: {self.text.splitlines()[0].strip() if self.text else ''}"


def blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page``, in order."""
    text = page.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        above = text[: match.start()].removesuffix("\n").rpartition("\n")[2]
        marker = MARKER.fullmatch(above)  # the line right above the fence
        found.append(
            Block(
                page=str(page.relative_to(ROOT)),
                line=text[: match.start()].count("\n") + 1,
                language=match[1],
                text=match[2],
                setup=marker[1].strip() if marker else None,
            )
        )
    return found


def every_block() -> list[Block]:
    """Every fenced block of every page, in page order."""
    return [block for page in pages() for block in blocks(page)]
