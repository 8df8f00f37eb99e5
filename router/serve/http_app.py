"""The HTTP console served: ``StatusService``'s routes as a Starlette app, on uvicorn, inside
the router's own event loop. Imported only when the console starts: Starlette and uvicorn
cost the write path and a processor's first claim nothing.

Rules, in the order they are checked:

- ``GET`` routes: with ``http.token`` set, all but ``/healthz``, ``/readyz`` and ``/`` (the
  dashboard page holds no data and asks for the token) need ``Authorization: Bearer <token>``.
- ``POST`` routes (they change state) are off without ``http.token`` (403). With it, a request
  that a browser marks as cross-site (``Origin`` not this host, ``Sec-Fetch-Site: cross-site``)
  is refused (403), then the bearer token is required (401). A body, when there is one, must
  be a JSON object (400).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import hmac
import json
import logging
import socket
from collections.abc import Awaitable, Callable, Generator
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response as StarletteResponse
from starlette.routing import Route as StarletteRoute

from envelopes import RouterError
from router.serve.console import (
    OPEN_ROUTES,
    Action,
    Params,
    Query,
    Response,
    Route,
    json_response,
)

if TYPE_CHECKING:
    from router.serve.console import StatusService

__all__ = ["HttpServer", "build_app", "console_server"]

log = logging.getLogger(__name__)

Endpoint = Callable[[Request], Awaitable[StarletteResponse]]

# Requests still running when the console stops get this long, then are cancelled; the
# server itself is given STOP_WAIT in all, so a stuck request never holds up a shutdown.
GRACE = 1
STOP_WAIT = 1.5


def console_server(service: StatusService) -> HttpServer:
    """An HTTP server with every route of ``service``, on ``http.bind``."""
    return HttpServer(service.config.http.host, service.config.http.port, build_app(service))


def build_app(service: StatusService) -> Starlette:
    """The console's routes, token rules and JSON errors as an ASGI app."""
    http = service.config.http
    token = http.token.get_secret_value().encode() if http.token else None
    gets = {path: _without_params(route) for path, route in service.routes().items()}
    gets.update(service.queries())
    routes = [
        StarletteRoute(path, _get(path, query, token), methods=["GET"])
        for path, query in gets.items()
    ]
    routes.extend(
        StarletteRoute(path, _post(action, token), methods=["POST"])
        for path, action in service.actions().items()
    )
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.router.redirect_slashes = False  # /healthz/ is no route, as it never was
    return app


def _without_params(route: Route) -> Query:
    async def query(params: Params) -> Response:
        return await route()

    return query


def _get(path: str, query: Query, token: bytes | None) -> Endpoint:
    async def endpoint(request: Request) -> StarletteResponse:
        if token is not None and path not in OPEN_ROUTES and not _authorised(request, token):
            return _send(json_response(401, {"error": "a bearer token is required"}))
        params = {**request.query_params, **request.path_params}
        return _send(await _answer(path, functools.partial(query, params)))

    return endpoint


def _post(action: Action, token: bytes | None) -> Endpoint:
    async def endpoint(request: Request) -> StarletteResponse:
        if token is None:
            return _send(json_response(403, {"error": "mutating routes are off: set http.token"}))
        refused = _cross_site(request)
        if refused is not None:
            return _send(json_response(403, {"error": refused}))
        # A required Authorization header is what keeps other sites out: an HTML form or any
        # other "simple" cross-site request cannot carry one, and a fetch() that sets it is
        # preflighted with OPTIONS, which this server never allows (405, no CORS headers),
        # so the browser does not send the POST. The token is no cookie, so no browser adds it
        # by itself. The Origin/Sec-Fetch-Site check above is a second wall, for any browser
        # that would get this wrong.
        if not _authorised(request, token):
            return _send(json_response(401, {"error": "a bearer token is required"}))
        body = _object(await request.body())
        if body is None:
            return _send(json_response(400, {"error": "the body must be a JSON object"}))
        client = request.client.host if request.client else "unknown"
        change = functools.partial(action, dict(request.path_params), body, f"http:{client}")
        return _send(await _answer(request.url.path, change))

    return endpoint


def _object(body: bytes) -> dict[str, Any] | None:
    """A POST's JSON body ({} for none); None when it is not a JSON object."""
    if not body.strip():
        return {}
    try:
        document = json.loads(body)
    except ValueError:
        return None
    return document if isinstance(document, dict) else None


async def _answer(path: str, route: Route) -> Response:
    try:
        return await route()
    except Exception as exc:  # a route's failure is an answer, never a dead server
        log.exception("http.route_failed", extra={"path": path})
        return json_response(500, {"error": type(exc).__name__})


def _authorised(request: Request, token: bytes) -> bool:
    scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token)


def _cross_site(request: Request) -> str | None:
    """Why a browser's request from another site is refused; None for this site's own."""
    if request.headers.get("sec-fetch-site", "").lower() == "cross-site":
        return "cross-site requests are refused (Sec-Fetch-Site: cross-site)"
    origin = request.headers.get("origin")
    host = request.headers.get("host", "").strip().lower()
    if origin is not None and urlsplit(origin).netloc.lower() != host:
        return f"cross-site requests are refused (Origin {origin} is not this host)"
    return None


def _send(answer: Response) -> StarletteResponse:
    headers = {**answer.headers, "Cache-Control": "no-store"}
    return StarletteResponse(answer.body, answer.status, headers, media_type=answer.content_type)


async def _http_error(request: Request, exc: Exception) -> StarletteResponse:
    """Starlette's own 404 and 405, as JSON."""
    assert isinstance(exc, HTTPException)
    path = request.url.path
    if exc.status_code == 404:
        routes = sorted(r.path for r in request.app.routes if isinstance(r, StarletteRoute))
        return _send(json_response(404, {"error": f"no route {path}", "routes": routes}))
    answer = json_response(exc.status_code, {"error": f"{request.method} is not served on {path}"})
    return _send(Response(answer.status, answer.body, headers=dict(exc.headers or {})))


class _Server(uvicorn.Server):
    """uvicorn's server as a task of the router's loop, which keeps its own signals.

    ``uvicorn.Server.serve`` (0.29 and later) wraps itself in ``capture_signals``, which sets
    ``signal.signal`` handlers for SIGINT and SIGTERM (replacing the ones ``router serve``
    added with ``loop.add_signal_handler``) and raises the captured signal again once it has
    stopped. The router decides when the console stops (``HttpServer.stop``), so nothing is
    captured here.
    """

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """Leave every signal handler as the router set it."""
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """Start serving, then say so to ``HttpServer.start``."""
        await super().startup(sockets)
        self.listening.set()


class HttpServer:
    """The console's app on uvicorn, as a task of the running event loop."""

    def __init__(self, host: str, port: int, app: Starlette) -> None:
        self.host = host
        self.port = port
        self.app = app
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._sockets: list[socket.socket] = []

    async def start(self) -> None:
        """Listen; the bound port is in ``self.port`` afterwards (useful with port 0).

        Raises ``RouterError`` naming ``http.bind`` when the address cannot be listened on.
        """
        # Bound here, not by uvicorn: a bind failure becomes the router's one-line error (uvicorn
        # would log it and sys.exit), and port 0's bound port can be read back.
        self._sockets, self.port = _listen(self.host, self.port)
        config = uvicorn.Config(
            self.app,
            # No logging.config from a library: records go to the handlers the CLI set. Its
            # own chatter (started, shutting down) is below WARNING, and there is no access log;
            # the router logs http.started itself.
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="off",
            http="h11",
            ws="none",
            interface="asgi3",
            proxy_headers=False,
            server_header=False,
            timeout_graceful_shutdown=GRACE,
        )
        server = self._server = _Server(config)
        self._task = asyncio.create_task(server.serve(self._sockets), name="http")
        listening = asyncio.create_task(server.listening.wait())
        await asyncio.wait([self._task, listening], return_when=asyncio.FIRST_COMPLETED)
        listening.cancel()
        if not server.listening.is_set():  # it ended before it served
            task = self._task
            await self.stop()
            cause = None if task.cancelled() else task.exception()
            bind = f"{self.host}:{self.port}"
            raise RouterError(f"http.bind {bind}: the console did not start") from cause
        log.info("http.started", extra={"bind": f"{self.host}:{self.port}"})

    async def stop(self) -> None:
        """Stop listening and close every connection, idle keep-alive ones at once."""
        server, task, self._server, self._task = self._server, self._task, None, None
        if server is not None and task is not None:
            server.should_exit = True
            _, late = await asyncio.wait([task], timeout=STOP_WAIT)
            if late:
                server.force_exit = True
                task.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await task
        for sock in self._sockets:
            sock.close()
        self._sockets = []


def _listen(host: str, port: int) -> tuple[list[socket.socket], int]:
    """Listening sockets on every address of ``host`` (as ``asyncio.start_server`` binds),
    all on one port: ``port``, or the one the first socket got for port 0."""
    bind = f"{host}:{port}"
    sockets: list[socket.socket] = []
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in dict.fromkeys(found):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((address[0], port, *address[2:]))
            port = sock.getsockname()[1]
            sock.listen(100)
            sock.setblocking(False)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise RouterError(_bind_problem(bind, exc)) from exc
    return sockets, port


def _bind_problem(bind: str, exc: OSError) -> str:
    """One line for the operator: which setting, what is wrong, what to do."""
    if exc.errno == errno.EADDRINUSE:
        return f"http.bind {bind} is already in use; stop the other process or change http.bind"
    reason = exc.strerror or str(exc)
    return f"http.bind {bind}: cannot listen ({reason}); change http.bind"
