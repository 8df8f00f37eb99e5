"""``router serve --workers N``: N worker processes under one parent.

Each worker is a full ``router serve`` (every processor of the config) with its own worker id;
they share the databases safely because claims are leased and fenced. The parent starts the
embedded brokers once, serves the HTTP health endpoint, restarts a worker that dies (a crash
or a SIGKILL), and on SIGINT/SIGTERM stops them all gracefully. Workers get SIGTERM if the
parent itself dies, so none is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from router.config import RouterConfig
from router.ops._embedded import embedded_brokers
from router.ops.console import StatusService
from router.ops.supervisor import check_config_schemas, cleanup_loop
from router.relay.metrics import multiprocess_registry

__all__ = ["WorkerPool"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_RESTART_MIN, _RESTART_MAX = 0.2, 10.0
_STABLE_AFTER = 30.0  # a worker that ran this long resets its restart back-off


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Worker:
    """One worker slot: its current process and how often it was restarted."""

    index: int
    process: asyncio.subprocess.Process | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff: float = _RESTART_MIN
    history: list[int] = field(default_factory=list)

    @property
    def pid(self) -> int | None:
        """The running process id, if any."""
        return self.process.pid if self.process else None


class WorkerPool:
    """Runs and supervises ``count`` worker processes."""

    def __init__(self, config: RouterConfig, count: int, child_args: Sequence[str]) -> None:
        self.config = config
        self.workers = [Worker(i) for i in range(count)]
        self._child_args = list(child_args)
        self._stopping = False

    async def run(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set; then stop every worker within the grace period."""
        await check_config_schemas(self.config)
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(embedded_brokers(self.config))
            metrics_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="router-metrics-"))
            # Workers write their counters here; the parent adds them up for /metrics.
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
            if self.config.http.enabled:
                service = StatusService(
                    self.config, multiprocess_registry(metrics_dir), self._health
                )
                http = service.server()
                await http.start()
                stack.push_async_callback(http.stop)
            stack.callback(asyncio.Task.cancel, asyncio.create_task(cleanup_loop(self.config)))
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
                await self._stop_all()
                for watcher in watchers:
                    watcher.cancel()
                await asyncio.gather(*watchers, return_exceptions=True)
        log.info("workers.stopped")

    async def _spawn(self, worker: Worker) -> None:
        worker.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "router",
            *self._child_args,
            env={**os.environ, "ROUTER_WORKER_INDEX": str(worker.index)},
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        worker.started_at = time.monotonic()
        worker.history.append(worker.process.pid)
        log.info("worker.started", extra={"worker": worker.index, "pid": worker.process.pid})

    async def _watch(self, worker: Worker) -> None:
        """Restart the worker whenever it exits while the pool is running."""
        while not self._stopping:
            assert worker.process is not None
            code = await worker.process.wait()
            if self._stopping:
                return
            ran = time.monotonic() - worker.started_at
            if ran > _STABLE_AFTER:
                worker.backoff = _RESTART_MIN
            log.warning(
                "worker.exited",
                extra={
                    "worker": worker.index,
                    "pid": worker.process.pid,
                    "code": code,
                    "restart_in": worker.backoff,
                },
            )
            await asyncio.sleep(worker.backoff)
            worker.backoff = min(worker.backoff * 2, _RESTART_MAX)
            if self._stopping:
                return
            worker.restarts += 1
            await self._spawn(worker)

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

    def _health(self) -> dict[str, Any]:
        workers = [
            {
                "index": w.index,
                "pid": w.pid,
                "restarts": w.restarts,
                "running": w.process is not None and w.process.returncode is None,
            }
            for w in self.workers
        ]
        return {"workers": workers, "all_running": all(w["running"] for w in workers)}
