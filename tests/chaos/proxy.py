"""TCP proxies that make the network misbehave, between the router and a broker.

``DelayingProxy`` delays what the server sends back: a slow network for the chaos run.
Between the router and NATS it holds every PubAck for ``delay`` seconds, so a worker killed
at almost any moment has messages the broker already stored but whose acks it never saw:
the duplicates at-least-once delivery allows, which the inbox must absorb.

``DelayingProxy.hold()`` stops forwarding in both directions while connections stay open (a gray
partition); ``stop()`` then drops what was held with the connections, as a host that dies
takes what it had not sent yet with it (the failover test's replication link).
``DelayingProxy.mute()`` drops what the server sends back from then on, while the client's
requests still reach it: answers lost on the way (a PubAck never seen for a message stored).
``DelayingProxy.stall_at(marker, frame)`` lets the client's bytes through up to the frame that
carries ``marker`` (or up to the marker itself) and holds everything from there: a sender cut
off half-way through a write (a JetStream batch whose members arrived and whose commit never
did, a command or a transfer half sent).

``GrayProxy`` cuts one host off: its connections stay open and pass nothing (a gray
partition), while other hosts' connections through the same proxy go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

__all__ = ["DelayingProxy", "GrayProxy"]


class _Proxy:
    """Listens on 127.0.0.1:port and forwards each connection to upstream through two pipes
    (client to server, server to client) that subclasses write."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Listen on a free port (``self.port``)."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

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
        client_port: int = client_writer.get_extra_info("peername")[1]
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_writer.close()
            return
        up = asyncio.create_task(self._pipe(client_reader, server_writer, client_port, False))
        down = asyncio.create_task(self._pipe(server_reader, client_writer, client_port, True))
        self._tasks.update((up, down))
        try:
            await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (up, down):
                task.cancel()
                self._tasks.discard(task)
            for writer in (client_writer, server_writer):
                writer.close()
            self._closed(client_port)

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        client_port: int,
        to_client: bool,
    ) -> None:
        raise NotImplementedError

    def _closed(self, client_port: int) -> None:
        """A connection ended."""


class DelayingProxy(_Proxy):
    """Forwards to upstream, server->client ``delay`` late."""

    def __init__(self, upstream_host: str, upstream_port: int, delay: float) -> None:
        super().__init__(upstream_host, upstream_port)
        self.delay = delay
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._muted = False
        self._stall: tuple[bytes, bytes | None] | None = None
        self._unstalled = asyncio.Event()
        self._unstalled.set()

    def hold(self) -> None:
        """Keep what either side sends, unsent, until ``release()`` (or ``stop()`` drops it)."""
        self._flowing.clear()

    def release(self) -> None:
        """Send what was held, and go on forwarding."""
        self._flowing.set()
        self._unstalled.set()

    def mute(self) -> None:
        """Drop what the server sends from now on; the client's bytes still go through."""
        self._muted = True

    def stall_at(self, marker: bytes, frame: bytes | None = None) -> None:
        """On the first client write that holds ``marker``, forward its bytes up to the last
        ``frame`` (a frame's opening, ``b"HPUB "`` say) before the marker, or up to the
        marker itself, and from there hold that connection's bytes until ``release()``
        (``stop()`` drops them)."""
        self._stall = (marker, frame)

    @property
    def stalled(self) -> bool:
        """A write was cut by ``stall_at`` and what followed it is held."""
        return not self._unstalled.is_set()

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        client_port: int,
        to_client: bool,
    ) -> None:
        delay = self.delay if to_client else 0.0
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes, bool]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data, stalled = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if stalled:  # what follows in the queue waits behind it
                    await self._unstalled.wait()
                await self._flowing.wait()
                if to_client and self._muted:
                    continue
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(deliver())
        try:
            while data := await reader.read(65536):
                due = loop.time() + delay
                at = -1 if to_client or self._stall is None else data.find(self._stall[0])
                if at >= 0:
                    assert self._stall is not None
                    frame = self._stall[1]
                    cut = at if frame is None else max(data.rfind(frame, 0, at), 0)
                    self._stall = None
                    self._unstalled.clear()
                    queue.put_nowait((due, data[:cut], False))
                    data = data[cut:]
                queue.put_nowait((due, data, at >= 0))
        finally:
            # Let what was read go out before the connection closes, then stop.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(delay + 0.05)
            sender.cancel()


class GrayProxy(_Proxy):
    """Forwards to upstream until ``cut(session)``: from then on, the connections of that
    process session (a host's ``router serve`` and its workers) pass nothing either way, and
    its new connections are accepted and then left silent, while every other client's go on.
    Nothing is closed: no FIN, no RST, as when a path drops packets. ``heal()`` lets
    everything through again.

    One proxy serves every host, so a broker whose clients are sent to the address it
    advertises (Kafka) can be reached only through it too. A connection's owner is found
    through /proc (Linux): the process holding the client's end of it.
    """

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        super().__init__(upstream_host, upstream_port)
        self.cut_session: int | None = None
        self._open = asyncio.Event()  # set while nothing is cut
        self._open.set()
        self._owners: dict[int, int | None] = {}  # client port -> session id (None: unknown)

    def cut(self, session: int) -> None:
        """Stop forwarding for every connection of process session ``session``."""
        self.cut_session = session
        self._open.clear()

    def heal(self) -> None:
        """Forward everything again (what was held back goes on)."""
        self.cut_session = None
        self._open.set()

    async def stop(self) -> None:
        """Heal, stop listening and drop every connection."""
        self.heal()
        await super().stop()

    def _closed(self, client_port: int) -> None:
        self._owners.pop(client_port, None)

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        client_port: int,
        to_client: bool,
    ) -> None:
        while data := await reader.read(65536):
            while self._is_cut(client_port):
                await self._open.wait()
            writer.write(data)
            await writer.drain()

    def _is_cut(self, client_port: int) -> bool:
        if self.cut_session is None:
            return False
        if client_port not in self._owners:
            self._owners[client_port] = _session_of_client(client_port, self.port)
        return self._owners[client_port] == self.cut_session


def _session_of_client(client_port: int, server_port: int) -> int | None:
    """The session id of the process holding the client end of a loopback TCP connection
    (local port ``client_port``, remote port ``server_port``), from /proc."""
    inode = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                local, remote = fields[1], fields[2]
                if (
                    int(local.rsplit(":", 1)[1], 16) == client_port
                    and int(remote.rsplit(":", 1)[1], 16) == server_port
                ):
                    inode = fields[9]
                    break
        if inode is not None:
            break
    if inode is None:
        return None
    wanted = f"socket:[{inode}]"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == wanted:
                        return os.getsid(int(pid))
    return None
