"""Start the broker servers a config asks the router to run itself (the embedded default)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from brokers import EmbeddedServer
from envelopes import BrokerUnavailable
from router.config import RouterConfig

__all__ = ["EmbeddedRun", "embedded_brokers"]


@dataclass(frozen=True, slots=True)
class EmbeddedRun:
    """One embedded server of a config, and who runs it."""

    server: EmbeddedServer
    started_here: bool
    owner_pid: int | None = None

    def describe(self) -> str:
        """How ``router check`` names it."""
        if self.started_here:
            return f"embedded server on {self.server.address}, started for this command"
        return (
            f"embedded server of a running router on {self.server.address} (pid {self.owner_pid})"
        )


@contextlib.asynccontextmanager
async def embedded_brokers(
    config: RouterConfig, *, reuse_running: bool = False
) -> AsyncIterator[dict[str, EmbeddedRun]]:
    """Run the embedded servers of ``config`` for the block; yields them by broker name.

    With ``reuse_running``, a server a running ``router serve`` started on the same store and
    port is used as it is (``router check`` runs beside it). Anything else answering on that
    port is a foreign server: an error, never taken for the embedded one.
    """
    runs: dict[str, EmbeddedRun] = {}
    by_address: dict[str, EmbeddedRun] = {}
    started: list[EmbeddedServer] = []
    try:
        for name, settings in config.brokers.items():
            server = settings.embedded_server(config.resolve_path)
            if server is None:
                continue
            run = by_address.get(server.address)
            if run is None:
                run = await _start_or_reuse(server, reuse_running=reuse_running)
                by_address[server.address] = run
                if run.started_here:
                    started.append(server)
            runs[name] = run
        yield runs
    finally:
        for server in reversed(started):
            await server.stop()


async def _start_or_reuse(server: EmbeddedServer, *, reuse_running: bool) -> EmbeddedRun:
    if reuse_running and await server.port_open():
        pid = server.owner_pid()
        if pid is None:
            raise BrokerUnavailable(
                f"embedded server: {server.address} answers, but not as a server this config's "
                "router started (no such server on its store); stop the other process, or "
                "change the broker's url"
            )
        return EmbeddedRun(server, started_here=False, owner_pid=pid)
    await server.start()
    return EmbeddedRun(server, started_here=True)
