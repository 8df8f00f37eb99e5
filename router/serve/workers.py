"""``router serve --workers N``: N worker processes under one parent.

Each worker is a full ``router serve`` (every processor of the config) with its own worker id;
they share the databases safely because claims are leased and fenced. The parent starts the
embedded brokers once, serves the HTTP health endpoint, and on SIGINT/SIGTERM/SIGHUP stops them
gracefully. Workers get SIGTERM if the parent itself dies, so none is left behind.

The parent picks each worker's id (``host:wN:pid:random``; the pid is filled in on both sides
of the fork) and hands it over as ``--worker-id``, so when it reaps a worker (any signal, any
exit code) it can give back that worker's leases at once: one UPDATE per database, fenced by
the id and 'processing', the attempt not counted. The other workers hear of it as of new rows:
NOTIFY on PostgreSQL, the file watcher on SQLite, the watch poll on MySQL (at its next look,
within its ``watch_interval``). The dead worker's streams go on within a second instead of
after its lease.

A worker is *ready* once its Runner has started its processors; it says so by writing
``ready <id>`` on a pipe the parent passed it (``$ROUTER_READY_FD``). A pipe needs no port, no
file and no polling, and its end of file tells a worker that died before it was ready. A worker
that dies after it was ready is replaced at once; one that dies before (a broken config or
environment) is started again after a back-off of 0.25 s, doubling up to 2 s, which goes back
to 0.25 s once a worker of that slot becomes ready.

Only this parent sees its workers die. Across hosts the lease stays the bound: a host whose
parent went away too (power, kernel, a SIGKILL of the whole process group) leaves its rows
leased until their lease ends, when any other host's workers claim them.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from router.config import RouterConfig
from router.relay.host_circuits import ENVIRONMENT as HOST_CIRCUITS
from router.relay.host_circuits import HostCircuits
from router.relay.metrics import multiprocess_registry
from router.relay.store import OutboxStore, open_store
from router.serve.console import StatusService
from router.serve.embedded import embedded_brokers
from router.serve.forkserver import Entry, Forkserver, die_with_parent
from router.serve.runner import (
    PID,
    READY_FD,
    backlog_loop,
    check_schemas,
    cleanup_loop,
    new_worker_id,
    with_pid,
)

__all__ = ["WorkerSupervisor"]

log = logging.getLogger(__name__)

_BACKOFF_MIN, _BACKOFF_MAX = 0.25, 2.0  # between starts of a worker that never became ready
_RELEASE_TIMEOUT = 10.0
_READY_AFTER_EXIT = 1.0  # how long a dead worker's pipe may still take to say what it wrote


class _Process(Protocol):
    """A worker's process: spawned (``asyncio.subprocess.Process``) or forked."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def send_signal(self, signum: int) -> None: ...

    def kill(self) -> None: ...


@dataclass
class Worker:
    """One worker slot: its current process, its id, and how it is restarted."""

    index: int
    id: str = ""
    process: _Process | None = None
    started_at: float = 0.0
    ready: bool = False
    readiness: asyncio.Task[bool] | None = None
    restarts: int = 0
    backoff: float = _BACKOFF_MIN
    history: list[int] = field(default_factory=list)

    @property
    def pid(self) -> int | None:
        """The running process id, if any."""
        return self.process.pid if self.process else None

    def restart_delay(self, was_ready: bool) -> float:
        """How long to wait before starting this slot again; advances the back-off."""
        if was_ready:
            return 0.0
        delay, self.backoff = self.backoff, min(self.backoff * 2, _BACKOFF_MAX)
        return delay


class WorkerSupervisor:
    """The process supervisor of ``router serve --workers N``: starts ``count`` worker
    processes, restarts one that dies (freeing its leases first) and stops them all."""

    def __init__(
        self,
        config: RouterConfig,
        count: int,
        child_args: Sequence[str],
        *,
        entry: Entry,
        fork: bool = True,
    ) -> None:
        """Make the pool before any event loop runs: with ``fork``, its fork server is a copy
        of this process as it is now (``router.serve.forkserver``)."""
        self.config = config
        self.workers = [Worker(i) for i in range(count)]
        self._child_args = list(child_args)
        # Workers write their counters here and the parent adds them up for /metrics. Set
        # before the fork server imports prometheus_client, which reads it on import.
        self._metrics_dir = tempfile.mkdtemp(prefix="router-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = self._metrics_dir
        # The workers' shared circuits (router.relay.host_circuits), one word per target: a
        # worker cut off from a broker stops its siblings' claims too. Kept in the metrics
        # folder, which goes when the pool does.
        circuits = os.path.join(self._metrics_dir, "circuits")
        HostCircuits.create(circuits, _targets(config))
        os.environ[HOST_CIRCUITS] = circuits
        self._forkserver = Forkserver.start(lambda: _preload(config), entry) if fork else None
        self._closing: asyncio.Task[None] | None = None
        self._stores: dict[str, OutboxStore] = {}
        self._stopping = False
        self._stopped = asyncio.Event()
        self._reaping: set[asyncio.Task[None]] = set()

    async def run(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set; then stop every worker within the grace period."""
        async with contextlib.AsyncExitStack() as stack:
            # Kept open: they give back a dead worker's leases, without a connect first.
            self._stores = {
                name: open_store(name, database, self.config.base_dir)
                for name, database in self.config.databases.items()
            }
            stack.push_async_callback(self._close_stores)
            stack.callback(shutil.rmtree, self._metrics_dir, ignore_errors=True)
            stack.push_async_callback(self._close_forkserver)
            await check_schemas(self._stores)
            await stack.enter_async_context(embedded_brokers(self.config))
            if self.config.http.enabled:
                from router.serve.http_app import console_server  # Starlette, uvicorn: now

                service = StatusService(
                    self.config, multiprocess_registry(self._metrics_dir), self._health
                )
                http = console_server(service)
                await http.start()
                stack.push_async_callback(http.stop)
            stack.callback(asyncio.Task.cancel, asyncio.create_task(cleanup_loop(self.config)))
            stack.callback(asyncio.Task.cancel, asyncio.create_task(backlog_loop(self.config)))
            for worker in self.workers:
                await self._spawn(worker)
            log.info(
                "workers.started",
                extra={"workers": len(self.workers), "pids": [w.pid for w in self.workers]},
            )
            watchers = [asyncio.create_task(self._watch(w)) for w in self.workers]
            try:
                await stop.wait()
            finally:
                self._stopping = True
                self._stopped.set()
                await self._stop_all()
                _, late = await asyncio.wait(watchers, timeout=_READY_AFTER_EXIT + 1)
                for watcher in late:
                    watcher.cancel()
                await asyncio.gather(*watchers, return_exceptions=True)
                # Each stopped worker is reaped too: what one killed past the grace period
                # still held is given back before the stores close.
                if self._reaping:
                    await asyncio.wait(self._reaping, timeout=_RELEASE_TIMEOUT + 1)
        log.info("workers.stopped")

    async def _spawn(self, worker: Worker) -> None:
        read_fd, write_fd = os.pipe()  # both ends close on exec; pass_fds hands one over
        worker_id = new_worker_id(worker.index, pid=PID)
        argv = [*self._child_args, "--worker-id", worker_id]
        env = {"ROUTER_WORKER_INDEX": str(worker.index)}
        try:
            process = await self._start(argv, env, write_fd)
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)  # the child's copy is the only writer: its exit ends the pipe
        worker.process = process
        worker.id = with_pid(worker_id, process.pid)
        worker.ready = False
        worker.started_at = time.monotonic()
        worker.history.append(process.pid)
        worker.readiness = asyncio.create_task(self._await_ready(worker, process, read_fd))
        log.info(
            "worker.started",
            extra={"worker": worker.index, "pid": process.pid, "worker_id": worker.id},
        )
        if self._stopping:  # started while the pool was stopping: stop it as the others
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)

    async def _start(self, argv: list[str], env: dict[str, str], ready_fd: int) -> _Process:
        """Fork the worker from the fork server; spawn ``python -m router`` without one."""
        if self._forkserver is not None:
            try:
                return await self._forkserver.spawn(argv, env, ready_fd)
            except (OSError, TimeoutError) as exc:
                log.warning("forkserver.failed", extra={"error": str(exc) or "no answer"})
                # From now on every worker is spawned; the server is closed and reaped.
                forkserver, self._forkserver = self._forkserver, None
                self._closing = asyncio.create_task(forkserver.close())
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "router",
            *argv,
            env={**os.environ, **env, READY_FD: str(ready_fd)},
            pass_fds=(ready_fd,),
            preexec_fn=die_with_parent if sys.platform == "linux" else None,
        )

    async def _await_ready(self, worker: Worker, process: _Process, read_fd: int) -> bool:
        """True once the worker wrote ``ready``; False at end of file (it died before)."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(read_fd, "rb", buffering=0)
        )
        try:
            line = await reader.readline()
        finally:
            transport.close()
        if not line.startswith(b"ready") or worker.process is not process:
            return False
        worker.ready, worker.backoff = True, _BACKOFF_MIN
        log.info(
            "worker.ready",
            extra={
                "worker": worker.index,
                "pid": process.pid,
                "seconds": round(time.monotonic() - worker.started_at, 3),
            },
        )
        return True

    async def _watch(self, worker: Worker) -> None:
        """Reap the worker whenever it exits; replace it while the pool is running."""
        while True:
            process, worker_id = worker.process, worker.id
            assert process is not None
            assert worker.readiness is not None
            code = await process.wait()
            was_ready = await _outcome(worker.readiness)
            delay = None if self._stopping else worker.restart_delay(was_ready)
            # Not awaited: a database that does not answer must not hold up the replacement
            # or its reaping. Made first, its statement is on its way before the fork of the
            # replacement, which holds this event loop for some milliseconds.
            reap = asyncio.create_task(
                self._reap(worker.index, process.pid, worker_id, code, was_ready, delay)
            )
            self._reaping.add(reap)
            reap.add_done_callback(self._reaping.discard)
            if delay is None or not await self._restart(worker, delay):
                return

    async def _restart(self, worker: Worker, delay: float) -> bool:
        """Start the slot again after ``delay``; False if the pool stopped first."""
        while True:
            if delay:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopped.wait(), delay)
            if self._stopping:
                return False
            try:
                await self._spawn(worker)
            except OSError as exc:  # no process to be had (a process or memory limit)
                delay = worker.restart_delay(was_ready=False)
                log.error(
                    "worker.spawn_failed",
                    extra={"worker": worker.index, "error": str(exc), "retry_in": delay},
                )
                continue
            worker.restarts += 1
            return True

    async def _reap(
        self,
        index: int,
        pid: int,
        worker_id: str,
        code: int,
        was_ready: bool,
        restart_in: float | None,
    ) -> None:
        """Give back a dead worker's leases in every database, then log one line: who, how
        it ended, what it held per database (or why that failed), when it comes back."""
        names = list(self._stores)
        results = await asyncio.gather(
            *(
                asyncio.wait_for(self._stores[n].release_worker(worker_id), _RELEASE_TIMEOUT)
                for n in names
            ),
            return_exceptions=True,
        )
        released: dict[str, int | str] = {}
        for name, result in zip(names, results, strict=True):
            if isinstance(result, BaseException):
                # The lease still bounds them: they come back when it ends.
                released[name] = f"failed: {str(result) or type(result).__name__}"
            else:
                released[name] = result
        ended: dict[str, object] = {"code": code}
        if code < 0:
            with contextlib.suppress(ValueError):
                ended = {"signal": signal.Signals(-code).name}
        log.log(
            logging.INFO if restart_in is None else logging.WARNING,
            "worker.reaped",
            extra={
                "worker": index,
                "pid": pid,
                "worker_id": worker_id,
                **ended,
                "ready": was_ready,
                "released": released,
                "restart_in": restart_in,
            },
        )

    async def _stop_all(self) -> None:
        running = [
            w.process
            for w in self.workers
            if w.process is not None and w.process.returncode is None
        ]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        grace = self.config.outbox.shutdown_grace_seconds + 5
        waits = [asyncio.create_task(p.wait()) for p in running]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=grace)
            for process in running:
                if process.returncode is None:
                    log.error("worker.killed", extra={"pid": process.pid})
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

    async def _close_forkserver(self) -> None:
        if self._forkserver is not None:
            await self._forkserver.close()
        if self._closing is not None:
            await self._closing

    async def _close_stores(self) -> None:
        for store in self._stores.values():
            await store.close()

    def _health(self) -> dict[str, Any]:
        workers = [
            {
                "index": w.index,
                "pid": w.pid,
                "worker_id": w.id,
                "restarts": w.restarts,
                "running": w.process is not None and w.process.returncode is None,
                "ready": w.ready and w.process is not None and w.process.returncode is None,
            }
            for w in self.workers
        ]
        return {"workers": workers, "all_running": all(w["running"] for w in workers)}


def _targets(config: RouterConfig) -> list[str]:
    """Every ``database/target`` of the config."""
    return [f"{db}/{target}" for db in config.databases for target in config.brokers_of(db)]


def _preload(config: RouterConfig) -> None:
    """In the fork server: import what a worker of ``config`` imports before its first claim
    (its database's store, its brokers' adapters and client libraries)."""
    importlib.import_module("router.serve.runner")
    stores = {"sqlite": "router.relay.store.sqlite", "mysql": "router.relay.store.mysql"}
    modules = {
        stores.get(db.kind, "router.relay.store.postgres") for db in config.databases.values()
    }
    modules |= {b.adapter.partition(":")[0] for b in config.brokers.values() if b.adapter}
    for module in sorted(modules):
        with contextlib.suppress(ImportError):  # the worker reports it, with the extra to install
            importlib.import_module(module)


async def _outcome(readiness: asyncio.Task[bool]) -> bool:
    """Whether a worker that exited had said it was ready (its pipe is read to the end)."""
    try:
        return await asyncio.wait_for(asyncio.shield(readiness), _READY_AFTER_EXIT)
    except Exception:  # no answer, or the pipe failed: not known to be ready
        readiness.cancel()
        return False
