"""``router check``: validate the config, then reach every database and broker.

Each database that answers gets a second line: the wake-up a relay starting now would use
(probed read-only, no follower started) and, short of the database's log, what to change.

It changes nothing: a stream or exchange that ``router serve`` would create is reported as
missing, with what serve would do; ``router check --create`` creates it. A destination the
broker would refuse (a NATS subject its stream does not capture, say) fails its broker's
check: ``stage()`` would refuse every such event in the application's transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from dataclasses import dataclass

from brokers import BrokerSettings, EventRoute, create_broker
from envelopes import MissingDestination, RouterError
from router.config import RouterConfig
from router.ops.migrate import current_revision, head_revision
from router.ops.wakeup import describe, probe
from router.serve.embedded import EmbeddedRun, embedded_brokers
from router.write.catalog import EventCatalog

__all__ = ["CheckResult", "destination_problems", "run_checks"]


@dataclass(frozen=True, slots=True)
class CheckResult:
    """The outcome of checking one database or broker."""

    kind: str
    name: str
    address: str
    ok: bool
    detail: str


async def run_checks(
    config: RouterConfig,
    timeout: float = 15.0,
    *,
    create: bool = False,
    catalog: EventCatalog | None = None,
) -> list[CheckResult]:
    """Check all databases and brokers concurrently; each check has its own time limit.

    With ``create``, streams and exchanges the brokers' settings create are created now.
    With ``catalog`` (the config's ``events:``), each event's destination on each broker
    that takes it is checked as ``stage()`` checks it.
    """
    async with embedded_brokers(config, reuse_running=True) as embedded:
        return await _check_all(config, timeout, embedded, create, catalog or EventCatalog())


async def _check_all(
    config: RouterConfig,
    timeout: float,
    embedded: dict[str, EmbeddedRun],
    create: bool,
    catalog: EventCatalog,
) -> list[CheckResult]:
    groups = await asyncio.gather(
        *(_database_and_wakeup(config, name, timeout) for name in config.databases),
        _brokers(config, timeout, embedded, create, catalog),
    )
    return [result for group in groups for result in group]


async def _database_and_wakeup(
    config: RouterConfig, name: str, timeout: float
) -> list[CheckResult]:
    """The database's line, then, once it answers, the wake-up a relay would use."""
    settings = config.databases[name]
    database = await _bounded(
        _check_database(config, name), "database", name, settings.public_url(), timeout
    )
    if not database.ok:
        return [database]
    wakeup = await _bounded(
        _check_wakeup(config, name), "wake-up", name, f"wakeup: {settings.wakeup}", timeout
    )
    return [database, wakeup]


async def _check_wakeup(config: RouterConfig, name: str) -> str:
    """A warning, not a failure, when the log is asked for and impossible: the relay then
    delivers all the same, woken by the fallback, and keeps trying the log."""
    wakeup = await probe(config, name)
    return describe(config.databases[name].wakeup, wakeup)


async def _brokers(
    config: RouterConfig,
    timeout: float,
    embedded: dict[str, EmbeddedRun],
    create: bool,
    catalog: EventCatalog,
) -> list[CheckResult]:
    checks = [
        _bounded(
            _check_broker(
                name,
                settings,
                embedded.get(name),
                create,
                destination_problems(settings, config.service, catalog),
                retry_horizon(config, settings) if settings.atomic else None,
            ),
            "broker",
            name,
            _broker_address(settings),
            timeout,
        )
        for name, settings in config.brokers.items()
    ]
    return list(await asyncio.gather(*checks))


async def _bounded(
    check: Awaitable[str], kind: str, name: str, address: str, timeout: float
) -> CheckResult:
    try:
        detail = await asyncio.wait_for(check, timeout)
    except TimeoutError:
        return CheckResult(kind, name, address, False, f"no answer within {timeout:.0f} s")
    except RouterError as exc:
        return CheckResult(kind, name, address, False, str(exc))
    except Exception as exc:  # report, never crash the whole check
        return CheckResult(kind, name, address, False, f"{type(exc).__name__}: {exc}")
    return CheckResult(kind, name, address, True, str(detail))


async def _check_database(config: RouterConfig, name: str) -> str:
    revision = await current_revision(name, config.databases[name], config.base_dir)
    head = head_revision()
    if revision is None:
        raise RouterError(
            f"{name}: reachable, but the outbox table is missing; run 'router init-db'"
        )
    if revision != head:
        raise RouterError(
            f"{name}: schema at {revision}, this router needs {head}; run 'router init-db'"
        )
    if config.databases[name].kind != "postgresql":
        return f"reachable, schema {revision}"
    from router._db import asyncpg_dsn
    from router.ops.pg_health import postgres_warnings

    warnings = await postgres_warnings(asyncpg_dsn(config.databases[name]), sorted(config.brokers))
    return "; ".join([f"reachable, schema {revision}", *(f"WARNING: {w}" for w in warnings)])


async def _check_broker(
    name: str,
    settings: BrokerSettings,
    embedded: EmbeddedRun | None,
    create: bool,
    problems: list[str],
    horizon: float | None = None,
) -> str:
    """``horizon``: an atomic target's retry horizon (``retry_horizon``), which the broker's
    duplicate window should cover."""
    creates = settings.creates()
    detail = "reachable"
    window = None
    try:
        window = await _reach(name, settings if create else settings.without_creating())
    except MissingDestination:
        if creates is None:
            raise
        # Missing, but serve would make it: not a failure, and check leaves it alone.
        detail += f"; {creates} does not exist: serve creates it (or run router check --create)"
    else:
        if creates is not None:
            detail += f", {creates} ready"
    if embedded is not None:
        detail += f" ({embedded.describe()})"
    if horizon is not None and window is not None and window < horizon:
        detail += (
            f"; WARNING: atomic, and the duplicate window is {window:g} s: a unit sent again "
            f"after its commit's answer was lost (up to {horizon:g} s later: lease, publish "
            "limit and circuit probe) would be stored twice; make the window longer"
        )
    if problems:
        raise RouterError("; ".join([detail, *problems]))
    return detail


def destination_problems(
    settings: BrokerSettings, service: str, catalog: EventCatalog
) -> list[str]:
    """Why this broker would refuse destinations its template makes: for each catalogued
    event it takes, as staging resolves it; first, what its settings alone tell
    (``BrokerSettings.template_problems``)."""
    template = settings.destination
    refused = settings.template_problems()
    if refused:
        return refused
    problems = []
    for event_class in catalog:
        spec = event_class.__event__
        if not settings.wants(spec.type, published=spec.published):
            continue
        version = settings.versions.get(spec.type, spec.version)
        try:
            settings.destination_for(EventRoute(spec.type, version, service, spec.destination))
        except ValueError as exc:
            problems.append(
                f"destination {template!r} for {spec.type} v{spec.version}: {exc}; stage() "
                "refuses it"
            )
    return problems


def retry_horizon(config: RouterConfig, settings: BrokerSettings) -> float:
    """How long after a lost answer to a unit's commit the relay may send the unit again:
    its lease ends (a worker that died), then a publish's limit and the circuit's longest
    wait between probes (a path that went silent). A longer broker outage can take longer."""
    outbox = config.outbox
    return outbox.lease_seconds + settings.publish_limit + outbox.circuit.probe_max_delay


async def _reach(name: str, settings: BrokerSettings) -> float | None:
    """Connect and ping; the broker's duplicate window where it has one (JetStream, and
    Redis: how long a unit's marker is kept)."""
    broker = create_broker(name, settings)
    try:
        await broker.connect()
        await broker.ping()
        window: float | None = getattr(broker, "duplicate_window", None)
        return window
    finally:
        with contextlib.suppress(Exception):
            await broker.close()


def _broker_address(settings: BrokerSettings) -> str:
    return f"{settings.type} {settings.public_url()}".strip()
