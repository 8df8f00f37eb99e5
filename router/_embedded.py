"""Start the embedded brokers a config asks for (``embedded:`` on a NATS broker)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from brokers.nats import EmbeddedNats, NatsSettings
from router.config import RouterConfig

__all__ = ["embedded_brokers"]


@contextlib.asynccontextmanager
async def embedded_brokers(
    config: RouterConfig, *, reuse_running: bool = False
) -> AsyncIterator[list[EmbeddedNats]]:
    """Run one server per embedded URL for the duration of the block.

    With ``reuse_running``, a port that already answers is taken to be a server started by a
    running ``router serve`` and left alone (``router check`` runs beside it).
    """
    servers: list[EmbeddedNats] = []
    seen: set[str] = set()
    try:
        for settings in config.brokers.values():
            if not isinstance(settings, NatsSettings) or settings.embedded is None:
                continue
            url = settings.servers()[0]
            if url in seen:
                continue
            seen.add(url)
            server = EmbeddedNats(url, config.resolve_path(settings.embedded.store_dir))
            if reuse_running and await server.port_open():
                continue
            await server.start()
            servers.append(server)
        yield servers
    finally:
        for server in reversed(servers):
            await server.stop()
