"""Which wake-up a database's relay uses, for ``router check``, ``router status`` and the
console: the running relay's own (``OutboxStore.wakeup``), or, from another process, what a
relay starting now would pick (``OutboxStore.probe_wakeup``: read-only, no follower).

``log`` (the database's own log) is the one to have; for any other, the reason says what to
change. A relay on a fallback still delivers everything, so this is advice, never a failure:
``wakeup: log`` asked for but impossible is a warning.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from envelopes import RouterError
from router.config import RouterConfig
from router.ops import connections
from router.relay.store import Wakeup, open_store
from router.relay.store.base import describe_error

__all__ = ["WakeupReport", "describe", "probe", "probe_all", "reports"]


@dataclass(frozen=True)
class WakeupReport:
    """One database's wake-up: ``setting`` is its ``wakeup:``; ``source`` 'relay' (the
    running relay's) or 'probe' (what a relay starting now would pick)."""

    database: str
    setting: str
    mechanism: str
    reason: str
    source: str

    @property
    def warning(self) -> bool:
        """The log was asked for and is not what wakes (or would wake) the relay."""
        return self.setting == "log" and self.mechanism != "log"

    @property
    def text(self) -> str:
        """One line for people: the mechanism and, short of the log, what to change."""
        return describe(self.setting, Wakeup(self.mechanism, self.reason))

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self) | {"warning": self.warning}


def describe(setting: str, wakeup: Wakeup) -> str:
    """``wakeup`` for people, given the ``wakeup:`` setting that led to it."""
    mechanism, reason = wakeup
    if mechanism == "log":
        return f"log: {reason}"
    if mechanism == setting:
        return f"{mechanism}: as configured; wakeup: auto uses the log where the server allows it"
    if setting == "log":
        return f"WARNING: {mechanism} until the log works (serve keeps trying): {reason}"
    return f"{mechanism}, not the log: {reason}"


async def probe(config: RouterConfig, name: str) -> Wakeup:
    """What a relay of database ``name`` starting now would use (the store's read-only
    probe; raises ``DatabaseError`` when the database cannot be asked)."""
    store = open_store(name, config.databases[name], config.base_dir)
    try:
        return await store.probe_wakeup()
    finally:
        await store.close()


async def probe_all(config: RouterConfig, database: str | None = None) -> list[WakeupReport]:
    """``probe`` for each database (or one); a database that cannot be asked is reported
    with mechanism 'unknown' and the error."""
    found = []
    for name in connections.database_names(config, database):
        try:
            wakeup = await probe(config, name)
        except RouterError as exc:
            wakeup = Wakeup("unknown", str(exc))
        except Exception as exc:  # a driver's own error: report it, never crash status
            wakeup = Wakeup("unknown", describe_error(exc))
        found.append(_report(config, name, wakeup, "probe"))
    return found


def reports(config: RouterConfig, active: Mapping[str, Wakeup]) -> list[WakeupReport]:
    """The running relay's wake-up of each of ``active``'s databases."""
    return [_report(config, name, wakeup, "relay") for name, wakeup in active.items()]


def _report(config: RouterConfig, name: str, wakeup: Wakeup, source: str) -> WakeupReport:
    setting = config.databases[name].wakeup
    return WakeupReport(name, setting, wakeup.mechanism, wakeup.reason, source)
