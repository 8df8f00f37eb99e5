"""The HTTP console of ``router serve``: health, readiness, metrics, the status API, the
dashboard, and pausing or resuming a target. Shared by a single router and by the parent of a
worker pool.

``StatusService`` holds the routes (async functions returning ``Response``);
``router.ops.http_app`` serves them with Starlette on uvicorn and holds the token rules. With a
token configured, every route but ``/healthz`` and ``/readyz`` (and the dashboard page itself,
which holds no data and asks for the token) needs ``Authorization: Bearer <token>``; without
one, the routes that change state are off.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import resources
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest

from envelopes import RouterError
from router.config import RouterConfig
from router.relay.metrics import BacklogCollector, counter_totals

if TYPE_CHECKING:
    # The operator queries run on SQLAlchemy, imported at the first request that reads the
    # backlog: the server itself is up before the processors start, so it must cost little.
    from router.ops.http_app import HttpServer
    from router.ops.operations import TargetStatus

__all__ = ["Response", "Route", "StatusService", "json_response"]

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


PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
# How long /healthz waits for a fresh database reading before it answers from the last one:
# a liveness probe must not fail, and get the router restarted, because a database is slow.
HEALTH_READ_WAIT = 1.0


class StatusService:
    """Everything the HTTP endpoint shows, read from the databases and the counters."""

    def __init__(
        self,
        config: RouterConfig,
        counters: CollectorRegistry,
        health: Callable[[], dict[str, Any]],
        max_age: float = 1.0,
    ) -> None:
        self.config = config
        self.counters = counters
        self.health = health
        self.max_age = max_age
        self.backlog = BacklogCollector()
        self._gauges = CollectorRegistry()
        self._gauges.register(self.backlog)
        self._read_at = 0.0
        self._lock = asyncio.Lock()
        self._error: str | None = None

    def server(self) -> HttpServer:
        """An HTTP server with every route, on ``http.bind``."""
        # Starlette and uvicorn: imported when the console starts, after the processors.
        from router.ops.http_app import HttpServer, build_app

        return HttpServer(self.config.http.host, self.config.http.port, build_app(self))

    def routes(self) -> dict[str, Route]:
        """The GET routes by path."""
        return {
            "/healthz": self.healthz,
            "/readyz": self.readyz,
            "/metrics": self.metrics,
            "/api/outbox": self.api,
            "/": self.dashboard,
        }

    async def rows(self) -> list[TargetStatus]:
        """The backlog, read at most once per ``max_age`` however many clients poll."""
        async with self._lock:
            if time.monotonic() - self._read_at >= self.max_age:
                from router.ops.operations import status

                try:
                    self.backlog.rows = await status(self.config, published=False)
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
        return json_response(200, {"status": "ok", **self.health(), "partner_circuits": partners})

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
        return json_response(
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
        return json_response(
            200 if self._error is None else 503,
            {
                "generated_at": datetime.now(UTC).isoformat(timespec="milliseconds"),
                "error": self._error,
                "targets": [
                    {**row.as_dict(), "since_start": totals.get((row.database, row.target), {})}
                    for row in rows
                ],
            },
        )

    async def dashboard(self) -> Response:
        """A self-contained page that polls /api/outbox and draws the figures."""
        page = resources.files("router.ops").joinpath("dashboard.html").read_bytes()
        return Response(200, page, "text/html; charset=utf-8")

    async def set_paused(self, database: str, target: str, *, paused: bool, by: str) -> Response:
        """Pause or resume one target in one database, as ``router pause/resume --database``."""
        if database not in self.config.databases:
            return json_response(404, {"error": f"unknown database {database!r}"})
        if target not in self.config.brokers_of(database):
            return json_response(404, {"error": f"database {database!r} has no target {target!r}"})
        from router.ops.operations import set_paused

        try:
            # As `router pause`: ``by`` on the target's row, and an audit row naming who.
            await set_paused(self.config, target, paused=paused, database=database, by=by, actor=by)
        except RouterError as exc:
            return json_response(503, {"error": str(exc)})
        self._read_at = 0.0  # the next status read shows the change
        event = "http.target_paused" if paused else "http.target_resumed"
        log.info(event, extra={"database": database, "target": target, "by": by})
        return json_response(200, {"database": database, "target": target, "paused": paused})
