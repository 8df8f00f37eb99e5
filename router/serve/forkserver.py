"""Worker processes forked from a pre-imported copy of the pool's parent (Linux).

A worker started with ``python -m router`` spends about a third of a second importing the
router, pydantic, the database driver and the broker client before it can claim a row, and
more on a busy machine; in a crash loop that is time its streams wait. So before its event
loop starts, ``router serve --workers N`` forks this *fork server*: a copy of itself with the
config loaded, the events modules and the worker's modules imported, and no event loop,
thread or connection yet. It waits on a socket; for each worker it forks twice and the
grandchild runs ``router serve --child`` (``cli.main``), claiming within milliseconds.

The middle process exits at once, so the worker is re-parented to the pool's parent, which
marks itself a *child subreaper*: the worker is the parent's child as if it had been spawned,
and the parent waits for it through a pidfd (``ForkedWorker``). The fork server itself stays
the parent's child and exits when the parent closes the socket or dies.

Elsewhere (not Linux), or when the fork server cannot be had, workers are spawned with
``python -m router`` as before. Workers forked here run the code the parent started with: a
worker restarted after a deploy does not pick up new code until the parent restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

__all__ = [
    "FORKSERVER_NAME",
    "Entry",
    "ForkedWorker",
    "Forkserver",
    "die_with_parent",
    "worker_pids",
]

log = logging.getLogger(__name__)

FORKSERVER_NAME = "router-forksrv"

Entry = Callable[[Sequence[str]], int]
"""What a forked worker runs: a ``main(argv)`` that returns the exit code."""
"""The fork server's process name (``/proc/<pid>/comm``): not a worker."""

_PR_SET_PDEATHSIG, _PR_SET_NAME, _PR_SET_CHILD_SUBREAPER = 1, 15, 36
_MAX_REQUEST = 1 << 16


def _prctl(option: int, value: int | bytes) -> bool:
    try:
        return int(ctypes.CDLL(None).prctl(option, value, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent() -> None:
    """SIGTERM this process when its parent dies (so no worker outlives its pool)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def worker_pids(parent: int) -> list[int]:
    """The worker processes of the pool whose parent is ``parent`` (from /proc: its children
    but the fork server), for tools and tests that signal workers."""
    pids: set[int] = set()
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{parent}/task").iterdir():
            with contextlib.suppress(OSError):
                pids.update(int(pid) for pid in (task / "children").read_text().split())
    return [pid for pid in sorted(pids) if _name(pid) != FORKSERVER_NAME]


def _name(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


class Forkserver:
    """The pool's side of the fork server: ``spawn`` a worker, ``close`` at the end."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self._sock = sock
        self.pid = pid
        self._lock = asyncio.Lock()

    @classmethod
    def start(cls, preload: Callable[[], None], entry: Entry) -> Forkserver | None:
        """Fork the server; None where it cannot work. Call before any event loop or
        thread exists: the fork copies this process as it is. Each worker runs
        ``entry(argv)`` (the ``router`` command's main, handed down so this module need not
        import the command line)."""
        if sys.platform != "linux" or not hasattr(os, "pidfd_open"):
            return None
        if not _prctl(_PR_SET_CHILD_SUBREAPER, 1):
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the fork server's own process
            code = 0
            try:
                ours.close()
                _serve(theirs, preload, entry)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        theirs.close()
        ours.setblocking(False)
        return cls(ours, pid)

    async def spawn(self, argv: Sequence[str], env: Mapping[str, str], fd: int) -> ForkedWorker:
        """Fork a worker that runs ``entry(argv)`` with ``env`` added to its environment,
        holding a copy of ``fd`` (named by ``$ROUTER_READY_FD``); ``OSError`` if it cannot."""
        request = json.dumps({"argv": list(argv), "env": dict(env)}).encode()
        loop = asyncio.get_running_loop()
        async with self._lock:  # one request, one answer
            socket.send_fds(self._sock, [request], [fd])
            answer = await asyncio.wait_for(loop.sock_recv(self._sock, 256), 10)
        if not answer:
            raise OSError("the fork server has exited")
        if not answer.isdigit():
            raise OSError(answer.decode(errors="replace"))
        return ForkedWorker(int(answer))

    async def close(self) -> None:
        """Stop the fork server (it exits on end of file) and reap it."""
        self._sock.close()
        with contextlib.suppress(ChildProcessError, OSError):
            await ForkedWorker(self.pid).wait()


class ForkedWorker:
    """A worker process the fork server made, as ``asyncio.subprocess.Process`` offers it:
    ``pid``, ``returncode``, ``wait()``, ``send_signal()``, ``kill()``. It is this process's
    child (re-parented here), so its exit status is ours to collect."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        # Held from the start: signals go to this process even if its pid is reused later.
        self._pidfd = os.pidfd_open(pid)
        self._waiting: asyncio.Future[int] | None = None

    async def wait(self) -> int:
        """Wait for the process to exit; its return code (minus the signal that killed it)."""
        if self.returncode is not None:
            return self.returncode
        if self._waiting is None:
            loop = asyncio.get_running_loop()
            self._waiting = loop.create_future()
            loop.add_reader(self._pidfd, self._exited, loop)
        return await asyncio.shield(self._waiting)

    def _exited(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.remove_reader(self._pidfd)
        try:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        except ChildProcessError:  # reaped elsewhere: the code is not known
            self.returncode = 255
        os.close(self._pidfd)
        assert self._waiting is not None
        if not self._waiting.done():
            self._waiting.set_result(self.returncode)

    def send_signal(self, signum: int) -> None:
        """Signal the process (``ProcessLookupError`` once it has exited)."""
        if self.returncode is not None:
            raise ProcessLookupError(self.pid)
        signal.pidfd_send_signal(self._pidfd, signum)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)


def _serve(
    sock: socket.socket, preload: Callable[[], None], entry: Entry
) -> None:  # pragma: no cover
    """The fork server's loop (its own process): one worker per request until end of file."""
    name = _name(os.getpid()) or "router"
    _prctl(_PR_SET_NAME, FORKSERVER_NAME.encode())
    pool = os.getppid()
    die_with_parent()
    # Ctrl-C reaches the whole process group; the parent stops the workers, and this server
    # goes when the parent closes the socket.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(Exception):  # a worker that cannot import says so itself
        preload()
    while True:
        message, fds, _, _ = socket.recv_fds(sock, _MAX_REQUEST, 1)
        if not message:
            return
        try:
            middle = os.fork()
        except OSError as exc:
            sock.send(f"cannot fork a worker: {exc}".encode())
            middle = 0
        else:
            if middle == 0:
                _middle(sock, message, fds, pool, name, entry)
        for fd in fds:
            os.close(fd)
        if middle:
            os.waitpid(middle, 0)


def _middle(
    sock: socket.socket, message: bytes, fds: list[int], pool: int, name: str, entry: Entry
) -> None:
    """Fork the worker, say its pid, exit: the worker is re-parented to the pool's parent."""
    try:
        worker = os.fork()
        if worker == 0:
            _prctl(_PR_SET_NAME, name.encode())  # a worker is named as its parent is
            _worker(sock, json.loads(message), fds, pool, entry)
        sock.send(str(worker).encode())
    except BaseException as exc:
        with contextlib.suppress(OSError):
            sock.send(f"cannot fork a worker: {exc}".encode())
    finally:
        os._exit(0)


def _worker(
    sock: socket.socket, request: dict[str, object], fds: list[int], pool: int, entry: Entry
) -> None:  # pragma: no cover
    """Become ``router serve --child``: never returns."""
    code = 1
    try:
        sock.close()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # The parent's death signal may only be asked for once this is its child: until the
        # middle process has exited it is the middle's, whose exit would send it.
        while os.getppid() != pool:
            if os.getppid() == 1:
                os._exit(1)
            os.sched_yield()
        die_with_parent()
        if os.getppid() != pool:  # the parent died in between
            os._exit(1)
        env, argv = request["env"], request["argv"]
        assert isinstance(env, dict)
        assert isinstance(argv, list)
        os.environ.update({str(k): str(v) for k, v in env.items()})
        if fds:
            from router.serve.runner import READY_FD

            os.environ[READY_FD] = str(fds[0])
        code = entry([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
