"""``router contract``: what partners receive, as a document (AsyncAPI 3.0), a lock to commit,
and a check of the code against that lock.

The contract covers partner brokers only (every broker but the internal one): per partner,
each published event version it receives, where (the destination staging resolves), in
which envelope (the profile, narrowed by ``omit`` and ``expose``), with which transport
headers, and the payload schema (the event class's, after the partner's ``expose.payload``
projection). ``_wire`` finds all of it through the real staging and rendering code;
``_asyncapi`` and ``_lock`` write it down; ``_diff`` compares two locks.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from envelopes import ConfigError
from router import __version__
from router.config import RouterConfig
from router.ops.contract._asyncapi import ASYNCAPI_VERSION, asyncapi_document
from router.ops.contract._diff import Change, compare
from router.ops.contract._lock import (
    LOCK_FILE,
    LOCK_FORMAT,
    lock_document,
    lock_text,
    os_reason,
    read_lock,
)
from router.ops.contract._wire import Member, PartnerMessage, partner_messages
from router.write.catalog import EventCatalog

__all__ = [
    "ASYNCAPI_VERSION",
    "LOCK_FILE",
    "LOCK_FORMAT",
    "Change",
    "CheckResult",
    "Member",
    "PartnerMessage",
    "asyncapi_document",
    "check",
    "compare",
    "export",
    "lock",
    "lock_document",
    "lock_text",
    "partner_messages",
    "read_lock",
    "shown",
    "write",
]


def export(config: RouterConfig, catalog: EventCatalog, out: str | None = None) -> str:
    """Write the AsyncAPI document to ``out`` (YAML for .yaml and .yml, else JSON); without
    ``out``, return it as JSON. With ``out``, return one line saying what was written."""
    document = asyncapi_document(config.service, __version__, partner_messages(config, catalog))
    if out is None:
        return json.dumps(document, indent=2, ensure_ascii=False) + "\n"
    if out.endswith((".yaml", ".yml")):
        text = yaml.safe_dump(document, sort_keys=False, allow_unicode=True)
    else:
        text = json.dumps(document, indent=2, ensure_ascii=False) + "\n"
    write(Path(out), text)
    return (
        f"{out}: AsyncAPI {document['asyncapi']}, {len(document['servers'])} partner(s), "
        f"{len(document['channels'])} channel(s), "
        f"{len(document['components']['messages'])} message(s)\n"
    )


def lock(config: RouterConfig, catalog: EventCatalog, path: Path) -> str:
    """Write the contract to the lock at ``path``; return one line saying what changed."""
    document = lock_document(config.service, partner_messages(config, catalog))
    text = lock_text(document)
    unchanged = path.exists() and path.read_text(encoding="utf-8") == text
    write(path, text)
    partners = document["partners"]
    versions = sum(len(v) for p in partners.values() for v in p["events"].values())
    state = "unchanged" if unchanged else "written"
    return f"{shown(path)}: {state}, {versions} event version(s) for {len(partners)} partner(s)"


@dataclass(frozen=True)
class CheckResult:
    """The code's contract compared with the lock."""

    lock: Path
    changes: list[Change]
    stale: bool  # the lock's text differs (in documentation or format only, when no change)

    @property
    def breaking(self) -> list[Change]:
        """The changes that break a partner."""
        return [c for c in self.changes if c.breaking]

    def human(self) -> str:
        """The changes, one line each, and what to do about them."""
        breaking, additive = len(self.breaking), len(self.changes) - len(self.breaking)
        if not self.changes:
            lines = [f"contract check: the code matches {shown(self.lock)}"]
            if self.stale:
                lines.append(
                    "(titles, descriptions or examples changed, or the lock is of an older "
                    "format: `router contract lock` rewrites it)"
                )
            return "\n".join(lines)
        lines = [
            f"contract check against {shown(self.lock)}: {breaking} breaking, "
            f"{additive} additive change(s)",
            *(change.line() for change in self.changes),
        ]
        if breaking:
            lines.append(
                "A breaking change needs a new version of the event (a class with the next "
                "version beside the old one); if the partner agreed to it, run "
                "`router contract lock` and commit the lock."
            )
        else:
            lines.append("No breaking change: run `router contract lock` to record these.")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """For ``--json``."""
        return {
            "lock": str(self.lock),
            "breaking": len(self.breaking),
            "changes": [change.as_dict() for change in self.changes],
        }


def check(config: RouterConfig, catalog: EventCatalog, lock: Path) -> CheckResult | None:
    """Compare the code's contract with the lock at ``lock``; None when there is no lock."""
    locked = read_lock(lock)
    if locked is None:
        return None
    current = lock_document(config.service, partner_messages(config, catalog))
    stale = lock_text(current) != lock.read_text(encoding="utf-8")
    return CheckResult(lock, compare(locked, current), stale)


def write(path: Path, text: str) -> None:
    """Write ``text`` to ``path``; a path that cannot be written is a one-line ConfigError."""
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot write {shown(path)}: {os_reason(path, exc)}") from None


def shown(path: Path) -> str:
    """A path as short as it can be shown: relative to the working directory when inside it."""
    relative = os.path.relpath(path)
    return str(path) if relative.startswith("..") else relative
