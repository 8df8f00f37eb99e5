"""A TCP proxy that delays what the server sends back: a slow network for the chaos run.

Between the router and NATS it holds every PubAck for ``delay`` seconds, so a worker killed
at almost any moment has messages the broker already stored but whose acks it never saw:
the duplicates at-least-once delivery allows, which the inbox must absorb.

``hold()`` stops forwarding in both directions while connections stay open (a gray
partition); ``stop()`` then drops what was held with the connections, as a host that dies
takes what it had not sent yet with it (the failover test's replication link).
"""

from __future__ import annotations

import asyncio
import contextlib

__all__ = ["DelayingProxy"]


class DelayingProxy:
    """Listens on 127.0.0.1:port and forwards to upstream, server->client ``delay`` late."""

    def __init__(self, upstream_host: str, upstream_port: int, delay: float) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.delay = delay
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()

    async def start(self) -> None:
        """Listen on a free port (``self.port``)."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def hold(self) -> None:
        """Keep what either side sends, unsent, until ``release()`` (or ``stop()`` drops it)."""
        self._flowing.clear()

    def release(self) -> None:
        """Send what was held, and go on forwarding."""
        self._flowing.set()

    async def stop(self) -> None:
        """Stop listening and drop every connection."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_writer.close()
            return
        up = asyncio.create_task(self._pipe(client_reader, server_writer, 0.0))
        down = asyncio.create_task(self._pipe(server_reader, client_writer, self.delay))
        self._tasks.update((up, down))
        try:
            await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (up, down):
                task.cancel()
                self._tasks.discard(task)
            for writer in (client_writer, server_writer):
                writer.close()

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float
    ) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(deliver())
        try:
            while data := await reader.read(65536):
                queue.put_nowait((loop.time() + delay, data))
        finally:
            # Let what was read go out before the connection closes, then stop.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(delay + 0.05)
            sender.cancel()
