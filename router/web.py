"""The routes ``router serve`` answers: health, readiness, metrics, the status API and the
dashboard. Shared by a single router and by the parent of a worker pool."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
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
        """The process runs."""
        return json_response(200, {"status": "ok", **self.health()})

    async def readyz(self) -> Response:
        """Every database answers and no target's circuit is open."""
        rows = await self.rows()
        open_circuits = [f"{r.database}/{r.target}" for r in rows if r.circuit == "open"]
        ready = self._error is None and not open_circuits
        return json_response(
            200 if ready else 503,
            {
                "status": "ready" if ready else "not ready",
                "database_error": self._error,
                "open_circuits": open_circuits,
            },
        )

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
