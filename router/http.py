"""The HTTP endpoint of ``router serve``, on asyncio streams (no web framework needed).

Routes are async functions returning ``Response``. With a token configured, every route but
``/healthz`` and ``/readyz`` (and the dashboard page itself, which holds no data and asks for
the token) needs ``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from envelopes import RouterError

__all__ = ["HttpServer", "Response", "json_response"]

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
