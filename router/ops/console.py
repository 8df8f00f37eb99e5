"""The HTTP console of ``router serve``: health, readiness, metrics, the status API and the
dashboard, on asyncio streams (no web framework needed). Shared by a single router and by the
parent of a worker pool.

``StatusService`` holds the routes (async functions returning ``Response``); ``HttpServer``
serves them. With a token configured, every route but ``/healthz`` and ``/readyz`` (and the
dashboard page itself, which holds no data and asks for the token) needs
``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
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
    from router.ops.operations import TargetStatus

__all__ = ["HttpServer", "Response", "StatusService", "json_response"]

log = logging.getLogger(__name__)

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
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


class HttpServer:
    """Serves a few GET routes."""

    def __init__(
        self, host: str, port: int, routes: dict[str, Route], token: str | None = None
    ) -> None:
        self.host = host
        self.port = port
        self.routes = routes
        self._token = token.encode() if token else None
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        """Listen; the bound port is in ``self.port`` afterwards (useful with port 0).

        Raises ``RouterError`` naming ``http.bind`` when the address cannot be listened on.
        """
        try:
            self._server = await asyncio.start_server(self._handle, self.host, self.port)
        except OSError as exc:
            raise RouterError(_bind_problem(f"{self.host}:{self.port}", exc)) from exc
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("http.started", extra={"bind": f"{self.host}:{self.port}"})

    async def stop(self) -> None:
        """Stop listening."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            response = await self._respond(request.decode("latin-1"))
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            response = json_response(400, {"error": "bad request"})
        head = (
            f"HTTP/1.1 {response.status} {_REASONS.get(response.status, 'OK')}\r\n"
            f"Content-Type: {response.content_type}\r\n"
            f"Content-Length: {len(response.body)}\r\nConnection: close\r\n"
            "Cache-Control: no-store\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in response.headers.items())
            + "\r\n"
        )
        with contextlib.suppress(ConnectionError):
            writer.write(head.encode() + response.body)
            await writer.drain()
        writer.close()

    async def _respond(self, request: str) -> Response:
        lines = request.split("\r\n")
        method, _, rest = lines[0].partition(" ")
        path = rest.partition(" ")[0].partition("?")[0]
        if method != "GET":
            return json_response(405, {"error": "only GET is served"})
        route = self.routes.get(path)
        if route is None:
            return json_response(404, {"error": f"no route {path}", "routes": sorted(self.routes)})
        if self._token is not None and path not in OPEN_ROUTES and not self._authorised(lines):
            return json_response(401, {"error": "a bearer token is required"})
        try:
            return await route()
        except Exception as exc:  # a route's failure is an answer, never a dead server
            log.exception("http.route_failed", extra={"path": path})
            return json_response(500, {"error": type(exc).__name__})

    def _authorised(self, lines: list[str]) -> bool:
        assert self._token is not None
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "authorization":
                scheme, _, given = value.strip().partition(" ")
                if scheme.lower() == "bearer":
                    return hmac.compare_digest(given.strip().encode(), self._token)
        return False


def _bind_problem(bind: str, exc: OSError) -> str:
    """One line for the operator: which setting, what is wrong, what to do."""
    if exc.errno == errno.EADDRINUSE:
        return f"http.bind {bind} is already in use; stop the other process or change http.bind"
    reason = exc.strerror or str(exc)
    return f"http.bind {bind}: cannot listen ({reason}); change http.bind"


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
