"""What ``router serve`` runs in one process: one processor per (database, broker) target.

Every database gets a store and a watcher (NOTIFY on PostgreSQL, the WAL watcher on SQLite)
that wakes the processors of the targets with new rows. A database that is down only stalls
its own processors, which keep retrying; a broker that is down only stalls its own target.
It also serves the HTTP endpoint and removes rows past their retention on a schedule.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import random
import socket
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from brokers import Broker, BrokerSettings, create_broker
from envelopes import DatabaseError, RouterError, SchemaError
from router._local import database_key, register
from router.config import RouterConfig
from router.relay.host_circuits import HostCircuits, SharedWord
from router.relay.metrics import Metrics
from router.relay.processor import Processor
from router.relay.store import OutboxStore, Wakeup, open_store
from router.serve.embedded import embedded_brokers
from router.write.catalog import check_partners, load_catalog
from router.write.pinning import Received

if TYPE_CHECKING:
    # The console (Starlette, uvicorn) and the operator queries (SQLAlchemy) are imported when
    # they start, after the processors: time a worker would otherwise spend before its first
    # claim.
    from router.serve.http_app import HttpServer

__all__ = [
    "INSTANCE",
    "BrokerFactory",
    "Runner",
    "backlog_loop",
    "check_config_schemas",
    "check_schemas",
    "cleanup_loop",
    "new_worker_id",
    "tell_parent_ready",
    "with_pid",
]

log = logging.getLogger(__name__)

BrokerFactory = Callable[[str, BrokerSettings], Broker]


PID = "{pid}"
"""Where a worker id chosen before its process exists (``new_worker_id(slot, pid=PID)``)
takes the process id, filled in by ``with_pid`` on both sides of the fork."""

READY_FD = "ROUTER_READY_FD"
"""The environment variable naming the pipe a pool worker reports ready on."""


INSTANCE = "ROUTER_INSTANCE"
"""The environment variable naming this router in its worker ids (``serve --instance``)."""


def new_worker_id(slot: int | None = None, *, pid: int | str | None = None) -> str:
    """``host:pid:random``, unique per running router process; ``host:wN:pid:random`` for
    slot N of a worker pool, whose parent picks it (with ``pid=PID``) and hands it over.
    ``host`` is ``$ROUTER_INSTANCE`` when set (several routers on one host, or containers
    whose host names say nothing), else the host name."""
    prefix = f"w{slot}:" if slot is not None else ""
    process = os.getpid() if pid is None else pid
    instance = os.environ.get(INSTANCE) or socket.gethostname()
    return f"{instance}:{prefix}{process}:{uuid.uuid4().hex[:6]}"


def with_pid(worker_id: str, pid: int) -> str:
    """A worker id picked before its process started, with that process's id filled in."""
    return worker_id.replace(PID, str(pid))


def tell_parent_ready(worker_id: str) -> None:
    """In a pool worker, once its processors run: write ``ready <id>`` on the pipe its parent
    gave it (``$ROUTER_READY_FD``), which ends that worker's restart back-off."""
    fd = os.environ.pop(READY_FD, None)
    if fd is None:
        return
    with contextlib.suppress(OSError, ValueError):  # a parent gone already: nothing to tell
        descriptor = int(fd)
        try:
            os.write(descriptor, f"ready {worker_id}\n".encode())
        finally:
            os.close(descriptor)


class Runner:
    """Starts, wakes and stops every processor of a config."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        worker_id: str | None = None,
        broker_factory: BrokerFactory = create_broker,
        databases: list[str] | None = None,
        start_embedded: bool = True,
        serve_http: bool = True,
        run_cleanup: bool = True,
        metrics: Metrics | None = None,
    ) -> None:
        self.config = config
        self.worker_id = worker_id or new_worker_id()
        self.metrics = metrics or Metrics()
        self.stores: dict[str, OutboxStore] = {}
        self.processors: list[Processor] = []
        self.http: HttpServer | None = None
        self._start_embedded = start_embedded
        self._serve_http = serve_http
        self._run_cleanup = run_cleanup
        self._exit_stack = contextlib.AsyncExitStack()
        self._tasks: list[asyncio.Task[None]] = []
        self._background: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        check_partners(config, load_catalog(config.events, config.base_dir))
        # In a worker of `router serve --workers N`: the circuits it shares with its siblings.
        self._host_circuits = HostCircuits.from_environment()
        for name in databases or list(config.databases):
            store = open_store(
                name,
                config.databases[name],
                config.base_dir,
                vacuum_after=config.outbox.vacuum_after_rows,
                durable=config.outbox.durable_bookkeeping,
            )
            self.stores[name] = store
            for target, settings in config.brokers_of(name).items():
                self.processors.append(
                    Processor(
                        database=name,
                        target=target,
                        settings=settings,
                        broker=broker_factory(target, settings),
                        store=store,
                        outbox=config.outbox,
                        worker_id=self.worker_id,
                        metrics=self.metrics,
                        render=Received(settings),
                        shared_circuit=self._shared_circuit(name, target),
                    )
                )

    def _shared_circuit(self, database: str, target: str) -> SharedWord | None:
        circuits = self._host_circuits
        return None if circuits is None else circuits.word(database, target)

    def processor(self, database: str, target: str) -> Processor:
        """The processor of one target."""
        for processor in self.processors:
            if processor.database == database and processor.target == target:
                return processor
        raise KeyError(f"{database}/{target}")

    def wake(self, database: str, targets: set[str] | None = None) -> None:
        """Wake the processors of ``database`` (only those of ``targets`` if given)."""
        for processor in self.processors:
            if processor.database == database and (targets is None or processor.target in targets):
                processor.wake()

    async def start(self) -> None:
        """Start embedded brokers, watchers, HTTP and processors; returns once they run."""
        self._loop = asyncio.get_running_loop()
        if self._host_circuits is not None:  # unmapped last, once every processor stopped
            self._exit_stack.callback(self._host_circuits.close)
        await check_schemas(self.stores)
        if self._start_embedded:
            await self._exit_stack.enter_async_context(embedded_brokers(self.config))
        for name, store in self.stores.items():
            watch = store.watch(functools.partial(self.wake, name))
            self._background.append(asyncio.create_task(watch, name=f"watch:{name}"))
            key = database_key(self.config.databases[name], self.config.base_dir)
            self._exit_stack.callback(register(key, functools.partial(self._announced, name)))
        if self.config.http.enabled and self._serve_http:
            # Starlette and uvicorn: imported when the console starts, after the processors.
            from router.serve.console import StatusService
            from router.serve.http_app import console_server

            service = StatusService(
                self.config, self.metrics.registry, self._health, wakeups=self._wakeups
            )
            self.http = console_server(service)
            await self.http.start()
            self._exit_stack.push_async_callback(self.http.stop)
        if self._run_cleanup:
            self._background.append(asyncio.create_task(cleanup_loop(self.config)))
            self._background.append(asyncio.create_task(backlog_loop(self.config)))
        for processor in self.processors:
            self._tasks.append(asyncio.create_task(processor.run(), name=processor.name))
        log.info(
            "router.started",
            extra={"worker": self.worker_id, "targets": [p.name for p in self.processors]},
        )
        tell_parent_ready(self.worker_id)

    async def run(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set, then shut down gracefully."""
        try:
            # Inside the try: a start that fails half way still closes what it opened (an
            # open SQLite connection's thread would keep the process alive).
            await self.start()
            stopped = asyncio.create_task(stop.wait())
            await asyncio.wait([stopped, *self._tasks], return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            for task in self._tasks:
                if task.done() and not task.cancelled() and task.exception():
                    log.error("processor.crashed", exc_info=task.exception())
        finally:
            await self.shutdown()

    def _announced(self, database: str, targets: set[str]) -> None:
        # Called after a COMMIT in this process, maybe from another thread's event loop.
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is self._loop:
            self.wake(database, targets)
        elif self._loop is not None:
            self._loop.call_soon_threadsafe(self.wake, database, targets)

    def _wakeups(self) -> dict[str, Wakeup]:
        return {name: store.wakeup for name, store in self.stores.items()}

    def _health(self) -> dict[str, Any]:
        return {
            "worker": self.worker_id,
            "processors": [
                {
                    "database": p.database,
                    "target": p.target,
                    "circuit": p.circuit.state,
                    "published": p.stats.published,
                    "failed": p.stats.failed,
                    "abandoned": p.stats.abandoned,
                    "last_error": p.stats.last_error,
                }
                for p in self.processors
            ],
        }

    async def shutdown(self) -> None:
        """Stop processors (they finish their batch within the grace period), then clean up."""
        try:
            for processor in self.processors:
                processor.stop()
            if self._tasks:
                _, pending = await asyncio.wait(
                    self._tasks, timeout=self.config.outbox.shutdown_grace_seconds
                )
                for task in pending:
                    task.cancel()
                await asyncio.gather(*self._tasks, return_exceptions=True)
            for task in self._background:
                task.cancel()
            await asyncio.gather(*self._background, return_exceptions=True)
            self._tasks, self._background = [], []
            for store in self.stores.values():
                await store.close()
        finally:
            # Whatever failed above: an embedded server or an open connection's thread left
            # behind would keep the process alive after serve has given up.
            await self._exit_stack.aclose()
        log.info("router.stopped", extra={"worker": self.worker_id})


async def check_schemas(stores: Mapping[str, OutboxStore], timeout: float = 5.0) -> None:
    """Raise ``SchemaError`` if a database's router tables are missing or older than this code.

    Without this, every claim would fail with "function router_claim(...) does not exist"
    forever. A database that cannot be reached now is only logged: its processors keep
    retrying until it is back, as they do for an outage later on.
    """
    names = list(stores)
    results = await asyncio.gather(
        *(asyncio.wait_for(stores[n].check_schema(), timeout) for n in names),
        return_exceptions=True,
    )
    for name, result in zip(names, results, strict=True):
        if isinstance(result, SchemaError):
            raise result
        if isinstance(result, DatabaseError | TimeoutError):
            error = str(result) or f"no answer within {timeout:g} s"
            stores[name].outage.failed(error)  # db.recovered follows when it answers
        elif isinstance(result, BaseException):
            raise result


async def check_config_schemas(config: RouterConfig) -> None:
    """``check_schemas`` for every database of a config, on connections of its own."""
    stores = {name: open_store(name, db, config.base_dir) for name, db in config.databases.items()}
    try:
        await check_schemas(stores)
    finally:
        for store in stores.values():
            await store.close()


async def backlog_loop(config: RouterConfig) -> None:
    """Apply the targets' ``on_backlog`` rules (router.serve.backlog), if any target has one."""
    if not any(b.on_backlog for db in config.databases for b in config.brokers_of(db).values()):
        return
    from router.serve.backlog import BACKLOG_CHECK_SECONDS, BacklogWatch  # SQLAlchemy: later

    await asyncio.sleep(BACKLOG_CHECK_SECONDS)  # not in the way of the first claims
    await BacklogWatch(config).run()


async def cleanup_loop(config: RouterConfig) -> None:
    """Remove rows past their retention every ``retention.interval`` (0: never)."""
    interval = config.outbox.retention.interval.total_seconds()
    if interval <= 0:
        return
    while True:
        # Spread routers that started together, so they do not all clean at once.
        await asyncio.sleep(interval * random.uniform(0.9, 1.1))
        from router.ops.outbox import cleanup  # SQLAlchemy: not before the first claim

        try:
            for done in await cleanup(config):
                if done.published or done.abandoned or done.gaps:
                    log.info(
                        "cleanup.done",
                        extra={
                            "database": done.database,
                            "published": done.published,
                            "abandoned": done.abandoned,
                            "gaps": done.gaps,
                        },
                    )
        except RouterError as exc:
            log.warning("cleanup.failed", extra={"error": str(exc)})
