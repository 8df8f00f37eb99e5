"""The routes ``router serve`` answers: health, readiness, metrics, the status API and the
dashboard. Shared by a single router and by the parent of a worker pool."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from importlib import resources
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from envelopes import RouterError
from router.config import RouterConfig
from router.http import HttpServer, Response, json_response
from router.metrics import BacklogCollector, counter_totals
from router.operations import TargetStatus, status

__all__ = ["StatusService"]

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
        """An HTTP server with every route."""
        http = self.config.http
        token = http.token.get_secret_value() if http.token else None
        return HttpServer(
            http.host,
            http.port,
            {
                "/healthz": self.healthz,
                "/readyz": self.readyz,
                "/metrics": self.metrics,
                "/api/outbox": self.api,
                "/": self.dashboard,
            },
            token=token,
        )

    async def rows(self) -> list[TargetStatus]:
        """The backlog, read at most once per ``max_age`` however many clients poll."""
        async with self._lock:
            if time.monotonic() - self._read_at >= self.max_age:
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
        page = resources.files("router").joinpath("dashboard.html").read_bytes()
        return Response(200, page, "text/html; charset=utf-8")
