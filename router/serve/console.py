"""The HTTP console of ``router serve``: health, readiness, metrics, the status API, the
dashboard, pausing or resuming a target, and the operator API (failure groups, requeue and
discard, the message browser, one message as each target receives it, the audit trail).
Shared by a single router and by the parent of a worker pool.

``StatusService`` holds the routes (async functions returning ``Response``);
``router.serve.http_app`` serves them with Starlette on uvicorn and holds the token rules. With a
token configured, every route but ``/healthz`` and ``/readyz`` (and the dashboard page itself,
which holds no data and asks for the token) needs ``Authorization: Bearer <token>``; without
one, the routes that change state are off. The operator API answers through the config's
``Redactor``: a secret a driver or broker quoted into an error is shown as ``***``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import resources
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest

from envelopes import ConfigError, RouterError
from router._secrets import Redactor, secrets_of
from router.config import RouterConfig
from router.relay.metrics import BacklogCollector, CounterRate, counter_totals

if TYPE_CHECKING:
    # The operator queries run on SQLAlchemy, imported at the first request that reads the
    # backlog: the server itself is up before the processors start, so it must cost little.
    from router.ops.status import TargetStatus
    from router.ops.wakeup import WakeupReport
    from router.relay.store import Wakeup

__all__ = ["Action", "Params", "Query", "Response", "Route", "StatusService", "json_response"]

log = logging.getLogger(__name__)

OPEN_ROUTES = frozenset({"/healthz", "/readyz", "/"})


@dataclass(frozen=True)
class Response:
    """What a route answers."""

    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


def json_response(status: int, document: Any) -> Response:
    """A JSON answer."""
    return Response(status, json.dumps(document, default=str).encode())


Route = Callable[[], Awaitable[Response]]
Params = Mapping[str, str]
"""A request's path parameters and query string."""
Query = Callable[[Params], Awaitable[Response]]
Action = Callable[[Params, Mapping[str, Any], str], Awaitable[Response]]
"""A route that changes state: path parameters, the JSON body, who asks (``http:<client>``)."""


PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
# How long /healthz waits for a fresh database reading before it answers from the last one:
# a liveness probe must not fail, and get the router restarted, because a database is slow.
HEALTH_READ_WAIT = 1.0
# How long the last minute's published rows (router.ops.flow) are reused between readings.
FLOW_REUSE = 5.0
DEFAULT_LIMIT = 50
MAX_LIMIT = 200
BAD_LIMIT = {"error": f"limit: a number of rows, at most {MAX_LIMIT}"}
RELEASE_BODY = 'the body is {"stream_key": "...", "reason": "...", "drop": false}'
# How long a probed wake-up (a worker pool's parent runs no relay of its own) is reused.
WAKEUP_PROBE_REUSE = 30.0


class StatusService:
    """Everything the HTTP endpoint shows, read from the databases and the counters."""

    def __init__(
        self,
        config: RouterConfig,
        counters: CollectorRegistry,
        health: Callable[[], dict[str, Any]],
        max_age: float = 1.0,
        wakeups: Callable[[], Mapping[str, Wakeup]] | None = None,
    ) -> None:
        """``wakeups``: the running relay's wake-up per database; without it (the parent of a
        worker pool), /api/outbox shows what a probe finds, and says so."""
        self.config = config
        self._active_wakeups = wakeups
        self._probed: tuple[float, list[WakeupReport]] | None = None
        self.counters = counters
        self.health = health
        self.max_age = max_age
        self.backlog = BacklogCollector()
        self._gauges = CollectorRegistry()
        self._gauges.register(self.backlog)
        self._read_at = 0.0
        self._lock = asyncio.Lock()
        self._error: str | None = None
        self._redact = Redactor(secrets_of(config))
        self._retries = CounterRate("retried")

    def routes(self) -> dict[str, Route]:
        """The GET routes by path."""
        return {
            "/healthz": self.healthz,
            "/readyz": self.readyz,
            "/metrics": self.metrics,
            "/api/outbox": self.api,
            "/": self.dashboard,
        }

    def queries(self) -> dict[str, Query]:
        """The GET routes that read path and query parameters, by path."""
        return {
            "/api/groups": self.groups,
            "/api/held": self.held,
            "/api/messages": self.messages,
            "/api/messages/{message_id}": self.message,
            "/api/audit": self.audit,
        }

    def actions(self) -> dict[str, Action]:
        """The POST routes, which change state, by path."""
        return {
            "/api/targets/{database}/{target}/pause": self.pause,
            "/api/targets/{database}/{target}/resume": self.resume,
            "/api/groups/{database}/{group_id}/requeue": self.requeue_group,
            "/api/groups/{database}/{group_id}/discard": self.discard_group,
            "/api/held/{database}/{target}/release": self.release_key,
        }

    async def rows(self) -> list[TargetStatus]:
        """The backlog, read at most once per ``max_age`` however many clients poll."""
        async with self._lock:
            if time.monotonic() - self._read_at >= self.max_age:
                from router.ops.status import status

                try:
                    self.backlog.rows = await status(
                        self.config, published=False, flow_reuse=FLOW_REUSE
                    )
                    self._error = None
                except RouterError as exc:
                    self._error = str(exc)
                self._read_at = time.monotonic()
        return list(self.backlog.rows)

    async def healthz(self) -> Response:
        """The process runs (always 200), with the partner circuits as last read."""
        with contextlib.suppress(TimeoutError):
            # Shielded: a reading that outlasts the wait goes on and serves the next request.
            await asyncio.wait_for(asyncio.shield(self.rows()), HEALTH_READ_WAIT)
        partners = self._partner_circuits(self.backlog.rows)
        return self._json(200, {"status": "ok", **self.health(), "partner_circuits": partners})

    async def readyz(self) -> Response:
        """Every database answers and the internal broker's circuits are closed.

        A partner's open circuit stalls only that partner's rows, so it is listed but makes the
        router unready only with ``http.ready_requires_partners``.
        """
        rows = await self.rows()
        open_circuits = [f"{r.database}/{r.target}" for r in rows if r.circuit == "open"]
        partners = self._partner_circuits(rows)
        requires_partners = self.config.http.ready_requires_partners
        blocking = [c for c in open_circuits if requires_partners or c not in partners]
        ready = self._error is None and not blocking
        return self._json(
            200 if ready else 503,
            {
                "status": "ready" if ready else "not ready",
                "database_error": self._error,
                "open_circuits": open_circuits,
                "partner_circuits": partners,
                "ready_requires_partners": requires_partners,
            },
        )

    def _partner_circuits(self, rows: Sequence[TargetStatus]) -> dict[str, str]:
        """``database/target`` -> circuit state, for every target not on the internal broker."""
        brokers = self.config.brokers
        return {
            f"{r.database}/{r.target}": r.circuit
            for r in rows
            if r.target not in brokers or not brokers[r.target].internal
        }

    async def metrics(self) -> Response:
        """Prometheus text: delivery counters, latency, and backlog gauges."""
        await self.rows()
        body = generate_latest(self.counters) + generate_latest(self._gauges)
        return Response(200, body, PROMETHEUS_TEXT)

    async def api(self) -> Response:
        """The status of every target as JSON, with counters since start."""
        rows = await self.rows()
        totals = counter_totals(self.counters)
        # One source: retries/min is router_retried_total's rate, not a count of the table's
        # failed rows (a row abandoned at its first attempt was never retried).
        retries = self._retries.per_minute(totals)
        return self._json(
            200 if self._error is None else 503,
            {
                "generated_at": datetime.now(UTC).isoformat(timespec="milliseconds"),
                "error": self._error,
                "targets": [_target(row, totals, retries) for row in rows],
                "wakeups": [report.as_dict() for report in await self.wakeups()],
            },
        )

    async def wakeups(self) -> list[WakeupReport]:
        """Each database's wake-up: the running relay's, or a probe's (reused a while)."""
        from router.ops import wakeup

        if self._active_wakeups is not None:
            return wakeup.reports(self.config, self._active_wakeups())
        if self._probed is None or time.monotonic() - self._probed[0] >= WAKEUP_PROBE_REUSE:
            self._probed = (time.monotonic(), await wakeup.probe_all(self.config))
        return self._probed[1]

    async def dashboard(self) -> Response:
        """A self-contained page that polls /api/outbox and draws the figures."""
        page = resources.files("router.serve").joinpath("dashboard.html").read_bytes()
        return Response(200, page, "text/html; charset=utf-8")

    async def set_paused(self, database: str, target: str, *, paused: bool, by: str) -> Response:
        """Pause or resume one target in one database, as ``router pause/resume --database``."""
        if database not in self.config.databases:
            return self._json(404, {"error": f"unknown database {database!r}"})
        if target not in self.config.brokers_of(database):
            return self._json(404, {"error": f"database {database!r} has no target {target!r}"})
        from router.ops.outbox import set_paused

        try:
            # As `router pause`: ``by`` on the target's row, and an audit row naming who.
            await set_paused(self.config, target, paused=paused, database=database, by=by, actor=by)
        except RouterError as exc:
            return self._json(503, {"error": str(exc)})
        self._read_at = 0.0  # the next status read shows the change
        event = "http.target_paused" if paused else "http.target_resumed"
        log.info(event, extra={"database": database, "target": target, "by": by})
        return self._json(200, {"database": database, "target": target, "paused": paused})

    async def pause(self, params: Params, body: Mapping[str, Any], actor: str) -> Response:
        """POST /api/targets/{database}/{target}/pause."""
        return await self.set_paused(params["database"], params["target"], paused=True, by=actor)

    async def resume(self, params: Params, body: Mapping[str, Any], actor: str) -> Response:
        """POST /api/targets/{database}/{target}/resume."""
        return await self.set_paused(params["database"], params["target"], paused=False, by=actor)

    # --- the operator API -------------------------------------------------------------------

    async def groups(self, params: Params) -> Response:
        """GET /api/groups: the failure groups, as ``router groups --json``."""
        from router.ops.groups import list_groups

        database = params.get("database") or None
        if database is not None and database not in self.config.databases:
            return self._unknown_database(database)
        try:
            found = await list_groups(self.config, database, params.get("target") or None)
        except RouterError as exc:
            return self._json(503, {"error": str(exc)})
        return self._json(200, {"groups": [group.as_dict() for group in found]})

    async def requeue_group(self, params: Params, body: Mapping[str, Any], actor: str) -> Response:
        """POST /api/groups/{database}/{group_id}/requeue: the group's rows back to pending."""
        return await self._act_on_group("requeue", params, body, actor)

    async def discard_group(self, params: Params, body: Mapping[str, Any], actor: str) -> Response:
        """POST /api/groups/{database}/{group_id}/discard: delete the group's rows."""
        return await self._act_on_group("discard", params, body, actor)

    async def _act_on_group(
        self, action: str, params: Params, body: Mapping[str, Any], actor: str
    ) -> Response:
        """As ``router requeue|discard --group``; ``{"dry_run": true}`` counts and changes
        nothing."""
        from router.ops import groups

        database, group_id = params["database"], params["group_id"]
        if database not in self.config.databases:
            return self._unknown_database(database)
        unknown = sorted(set(body) - {"dry_run"})
        if unknown or not isinstance(body.get("dry_run", False), bool):
            # A misspelt dry_run must not act for real.
            return self._json(400, {"error": 'the body is {"dry_run": true} or {}'})
        dry_run = bool(body.get("dry_run", False))
        try:
            group = await groups.find_group(self.config, group_id, database)
            if group is None:
                error = f"no failure group {group_id!r} in database {database!r}"
                return self._json(404, {"error": error})
            if action == "requeue":
                rows = await groups.requeue_group(self.config, group, dry_run=dry_run, actor=actor)
            else:
                rows = await groups.discard(self.config, group, dry_run=dry_run, actor=actor)
        except RouterError as exc:
            return self._json(503, {"error": str(exc)})
        if not dry_run:
            self._read_at = 0.0  # the next status read shows the change
            extra = {"database": database, "group": group_id, "rows": rows, "by": actor}
            log.info(f"http.group_{action}", extra=extra)
        return self._json(
            200, {"group": group.id, "database": database, "rows": rows, "dry_run": dry_run}
        )

    async def held(self, params: Params) -> Response:
        """GET /api/held: the held and parked stream keys, as ``router held --json``."""
        from router.ops.held import held_keys

        database = params.get("database") or None
        if database is not None and database not in self.config.databases:
            return self._unknown_database(database)
        target = params.get("target") or None
        try:
            found = await held_keys(self.config, target, database)
        except ConfigError as exc:
            return self._json(404, {"error": str(exc)})
        except RouterError as exc:
            return self._json(503, {"error": str(exc)})
        return self._json(200, {"keys": [key.as_dict() for key in found]})

    async def release_key(self, params: Params, body: Mapping[str, Any], actor: str) -> Response:
        """POST /api/held/{database}/{target}/release, body ``{"stream_key": ..., "reason":
        ..., "drop": false}``: as ``router release``: the head tried again (or, with drop,
        abandoned and its gap recorded) and the rest of the key back in order, audited."""
        from router.ops.held import release

        database, target = params["database"], params["target"]
        if database not in self.config.databases:
            return self._unknown_database(database)
        key, reason, drop = body.get("stream_key"), body.get("reason"), body.get("drop", False)
        unknown = sorted(set(body) - {"stream_key", "reason", "drop"})
        if unknown or not isinstance(key, str) or not isinstance(reason, str):
            return self._json(400, {"error": RELEASE_BODY})
        if not isinstance(drop, bool):  # a misspelt drop must not drop
            return self._json(400, {"error": RELEASE_BODY})
        if not reason.strip():
            return self._json(400, {"error": "a release needs a reason, for the audit trail"})
        try:
            released = await release(
                self.config, target, key, drop=drop, reason=reason, actor=actor, database=database
            )
        except ConfigError as exc:  # an unknown target
            return self._json(404, {"error": str(exc)})
        except RouterError as exc:
            return self._json(503, {"error": str(exc)})
        if not released:
            error = f"stream key {key!r} is neither held nor parked on {target!r} in {database!r}"
            return self._json(404, {"error": error})
        self._read_at = 0.0  # the next status read shows the change
        extra = {"database": database, "target": target, "drop": drop, "by": actor}
        log.info("http.release", extra=extra)
        return self._json(200, {"released": [r.as_dict() for r in released]})

    async def messages(self, params: Params) -> Response:
        """GET /api/messages: one entry per outbox row, newest first, filtered and paged."""
        from router.ops.browse import QueryError, messages

        database = params.get("database") or None
        if database is not None and database not in self.config.databases:
            return self._unknown_database(database)
        limit = _limit(params)
        if limit is None:
            return self._json(400, BAD_LIMIT)
        try:
            rows, after = await messages(
                self.config,
                database=database,
                q=params.get("q"),
                event_type=params.get("type"),
                stream_key=params.get("stream_key"),
                status=params.get("status"),
                error=params.get("error"),
                target=params.get("target"),
                limit=limit,
                before=params.get("before"),
            )
        except QueryError as exc:
            return self._json(400, {"error": str(exc)})
        except RouterError as exc:
            return self._json(503, {"error": str(exc)})
        return self._json(200, {"messages": [r.as_dict() for r in rows], "next_before": after})

    async def message(self, params: Params) -> Response:
        """GET /api/messages/{message_id}: every target's row, with the message it receives."""
        from router.ops.browse import message

        message_id = params["message_id"]
        try:
            targets = await message(self.config, message_id)
        except RouterError as exc:
            return self._json(503, {"error": str(exc)})
        if not targets:
            return self._json(404, {"error": f"no message {message_id!r}"})
        return self._json(200, {"message_id": message_id, "targets": targets})

    async def audit(self, params: Params) -> Response:
        """GET /api/audit: the operator actions, newest first, as ``router audit --json``."""
        from router.ops.audit import history

        database = params.get("database") or None
        if database is not None and database not in self.config.databases:
            return self._unknown_database(database)
        limit = _limit(params)
        if limit is None:
            return self._json(400, BAD_LIMIT)
        try:
            rows = await history(self.config, database, limit)
        except RouterError as exc:
            return self._json(503, {"error": str(exc)})
        return self._json(200, {"entries": [row.as_dict() for row in rows]})

    def _unknown_database(self, database: str) -> Response:
        return self._json(404, {"error": f"unknown database {database!r}"})

    def _json(self, status: int, document: Any) -> Response:
        """A JSON answer with every secret of the config replaced by ``***``."""
        return json_response(status, _redacted(document, self._redact))


def _target(
    row: TargetStatus,
    totals: Mapping[tuple[str, str], dict[str, float]],
    retries: Mapping[tuple[str, str], float],
) -> dict[str, Any]:
    """One target as /api/outbox shows it: the status, the counters since start, and whether
    nothing calls for an operator (no abandoned row, no held or parked key, circuit closed,
    not paused)."""
    key = (row.database, row.target)
    waiting = row.held_keys or row.parked_keys
    healthy = row.abandoned == 0 and not waiting and row.circuit == "closed" and not row.paused
    return {
        **row.as_dict(),
        "retries_per_minute": retries.get(key, 0.0),
        "healthy": healthy,
        "since_start": totals.get(key, {}),
    }


def _limit(params: Params) -> int | None:
    """``limit`` (default DEFAULT_LIMIT), at most MAX_LIMIT; None when it is no number."""
    text = params.get("limit", "").strip()
    if not text:
        return DEFAULT_LIMIT
    return max(1, min(int(text), MAX_LIMIT)) if text.isdigit() else None


def _redacted(value: Any, redact: Redactor) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {key: _redacted(item, redact) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redacted(item, redact) for item in value]
    return value
