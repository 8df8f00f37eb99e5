"""The HTTP endpoint of ``router serve`` (health and per-target counters).

Deliberately tiny, on asyncio streams: ``GET /healthz`` answers while the process runs;
``GET /api/processors`` lists each target's counters since start. Bound to 127.0.0.1 by
default (``http.bind``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

__all__ = ["HttpServer"]

log = logging.getLogger(__name__)

Route = Callable[[], tuple[int, dict[str, Any]]]

_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 400: "Bad Request"}


class HttpServer:
    """Serves JSON for a few GET routes."""

    def __init__(self, host: str, port: int, routes: dict[str, Route]) -> None:
        self.host = host
        self.port = port
        self.routes = routes
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        """Listen; the bound port is in ``self.port`` afterwards (useful with port 0)."""
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
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
            method, _, rest = request.decode("latin-1").partition(" ")
            path = rest.partition(" ")[0].partition("?")[0]
            status, body = self._route(method, path)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            status, body = 400, {"error": "bad request"}
        payload = json.dumps(body, default=str).encode()
        head = (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'OK')}\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
        )
        with contextlib.suppress(ConnectionError):
            writer.write(head.encode() + payload)
            await writer.drain()
        writer.close()

    def _route(self, method: str, path: str) -> tuple[int, dict[str, Any]]:
        if method != "GET":
            return 405, {"error": "only GET is served"}
        route = self.routes.get(path)
        if route is None:
            return 404, {"error": f"no route {path}", "routes": sorted(self.routes)}
        return route()
