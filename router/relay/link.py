"""The relay's one owner of a broker connection: connect, publish within a deadline, watch
for silence, ping, probe, reconnect, and the target's circuit.

Nothing else in ``router.relay`` opens, uses or closes a broker connection
(``tests/unit/test_relay_link.py`` says so): ``Delivery`` hands its waves to
``BrokerLink.publish`` and reports what they say about the path (``answered``, ``cut_off``);
the ``Processor`` asks ``is_open`` before it claims and ``probe`` while the circuit is open.

Every connect, the one a publish makes first included, runs in a task that ``stop()``
cancels, so that a batch waiting for its connection at shutdown is given back at once rather
than holding the stop for ``connect_timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from brokers import AtomicBroker, Broker, BrokerSettings, OutgoingMessage, PublishResult
from envelopes import BrokerError
from router.relay.circuit import Circuit
from router.relay.metrics import Metrics
from router.relay.silence import AnswerTime
from router.relay.stats import ProcessorStats

__all__ = ["BrokerLink"]

log = logging.getLogger(__name__)


class BrokerLink:
    """One target's broker connection and its health, as one worker process sees them."""

    def __init__(
        self,
        broker: Broker,
        settings: BrokerSettings,
        circuit: Circuit,
        *,
        stats: ProcessorStats,
        labels: dict[str, str],
        metrics: Metrics | None = None,
    ) -> None:
        self.broker = broker
        self.settings = settings
        self.circuit = circuit
        self.stats = stats
        self._log = labels
        self._metrics = metrics
        self._stopping = False
        self._connects: set[asyncio.Future[None]] = set()
        # A publish went unanswered on the current connection: the probe replaces it. (Not
        # closed at once: closing a silent connection can itself hang, and the batch's rows
        # must go back first.)
        self._suspect = False
        # How long publishes take, and how long pings do: apart, since a ping can cost far
        # more than a publish (a Service Bus ping attaches a link and puts a token: ~0.5 s
        # where a publish takes 15 ms), and a healthy broker must not be found silent because
        # its ping took longer than its publishes do.
        self._answer = AnswerTime(settings.silence_timeout, settings.publish_timeout)
        self._pings = AnswerTime(settings.silence_timeout, settings.publish_timeout)
        self._timing: asyncio.Future[None] | None = None  # the ping timing a new connection

    @property
    def is_open(self) -> bool:
        """True while this host cannot reach the broker: claim nothing, probe."""
        return self.circuit.is_open

    @property
    def on_trial(self) -> bool:
        """A probe got through and no publish was answered since (``router.relay.circuit``)."""
        return self.circuit.trial

    def answered(self) -> None:
        """A wave was answered (every message acknowledged or refused by the broker)."""
        self.circuit.reachable()

    def cut_off(self, error: str) -> None:
        """A wave went unanswered: this host's path to the broker is broken."""
        self.circuit.cut_off(error)

    async def publish(self, messages: list[OutgoingMessage]) -> list[PublishResult]:
        """Publish one wave and return one result per message. A broker that cannot be
        reached or used, or stays silent, gives every message a ``cut_off`` result (no
        verdict on the message); an adapter bug fails them all, retryable."""
        return await self._publish(messages, lambda: self.broker.publish(messages))

    async def publish_atomic(self, units: list[list[OutgoingMessage]]) -> list[list[PublishResult]]:
        """Publish one wave of atomic units (``brokers.AtomicBroker``): per unit, one result
        per member, every member with the unit's verdict. Watched as ``publish`` is; a
        broker that gives no verdict leaves every member of every unit cut off."""
        broker = self.broker
        if not isinstance(broker, AtomicBroker):  # the config refuses atomic on such a kind
            raise TypeError(f"{self._log['target']}: {type(broker).__name__} has no atomic write")

        async def send() -> list[PublishResult]:
            return [result for unit in await broker.publish_atomic(units) for result in unit]

        results = iter(await self._publish([m for unit in units for m in unit], send))
        return [[next(results) for _ in unit] for unit in units]

    async def _publish(
        self, messages: list[OutgoingMessage], send: Callable[[], Awaitable[list[PublishResult]]]
    ) -> list[PublishResult]:
        """``send()`` (the publish of ``messages``) on a connection, watched and timed."""
        started = time.perf_counter()
        try:
            results = await self._watched(send)
            if self._metrics is not None:  # one wave: from the first send to the last ack
                self._metrics.publish.labels(self._log["database"], self._log["target"]).observe(
                    time.perf_counter() - started
                )
        except BrokerError as exc:  # unreachable, or unusable (e.g. its stream cannot be made)
            return self._unusable(messages, str(exc))
        except TimeoutError:
            target = self._log["target"]
            return self._unusable(messages, f"{target}: no answer within publish_timeout")
        except _Silent as exc:
            return self._unusable(messages, str(exc))
        except Exception as exc:  # an adapter bug must not stop delivery to other targets
            log.exception("broker.error", extra=self._log)
            error = f"{type(exc).__name__}: {exc}"
            self.stats.last_error = error
            await self.disconnect()
            return [PublishResult.failed(error, retryable=True) for _ in messages]
        if len(results) != len(messages):
            error = f"adapter returned {len(results)} results for {len(messages)} messages"
            return [PublishResult.failed(error, retryable=True) for _ in messages]
        if any(r.unreachable for r in results):
            self._suspect = True
        return results

    async def probe(self) -> float | None:
        """Circuit open: once a probe is due, try a fresh connection and a round trip.
        Returns how long to wait for the next probe, or None once the circuit is closed."""
        wait = self.circuit.probe_in()
        if wait > 0:
            return wait
        try:
            await self._round_trip()
        except (BrokerError, TimeoutError) as exc:
            self.circuit.probe_failed(str(exc) or "no answer within the timeout")
            await self.disconnect()
            return self.circuit.probe_in()
        self.circuit.probed()
        return None

    async def disconnect(self) -> None:
        """Drop the connection; the next publish connects again."""
        self._answer.reconnected()
        self._pings.reconnected()
        if self._timing is not None:
            self._timing.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.broker.close(), 5)

    def stop(self) -> None:
        """Cancel every connect under way; from now on only a broker that is already
        connected gets on with its publish."""
        self._stopping = True
        for connect in self._connects:
            connect.cancel()

    def stopped_connect(self) -> bool:
        """True when the CancelledError being handled came from ``stop()`` cancelling a
        connect, not from the current task being cancelled."""
        task = asyncio.current_task()
        return self._stopping and task is not None and not task.cancelling()

    async def _round_trip(self) -> None:
        """A fresh connection and a ping (raises BrokerError or TimeoutError)."""
        if self._suspect:  # the connection that went silent: never trust it again
            await self.disconnect()
            self._suspect = False
        limit = self.settings.connect_timeout * 2 + 1
        async with asyncio.timeout(limit):
            await self._connect()
            pinged = time.monotonic()
            await self.broker.ping()
        self._pinged(time.monotonic() - pinged)

    async def _connect(self) -> None:
        """``broker.connect()`` in a task ``stop()`` cancels; after ``stop()``, only a broker
        that is already connected (returns at once) gets on."""
        connect = asyncio.ensure_future(self.broker.connect())
        self._connects.add(connect)
        try:
            if self._stopping:
                await asyncio.sleep(0)
                connect.cancel()  # a no-op once connected
            await connect
        finally:
            self._connects.discard(connect)
            connect.cancel()  # when we were cancelled before awaiting it

    async def _connected(
        self, send: Callable[[], Awaitable[list[PublishResult]]]
    ) -> list[PublishResult]:
        await self._connect()
        return await send()

    async def _watched(
        self, send: Callable[[], Awaitable[list[PublishResult]]]
    ) -> list[PublishResult]:
        """The results of ``send()`` (a publish), within ``publish_limit``.

        Once the broker's answer time is known (``router.relay.silence``), a publish still
        unanswered after its limit has the connection asked for a round trip (``ping``);
        when that is not answered within the pings' own limit, the path is silent
        (``_Silent``). So a host cut off from its broker knows within the two limits (half a
        second on a quick broker), instead of holding its batch, and on PostgreSQL the
        target, for the whole publish timeout; a broker that answers the ping but
        acknowledges slowly gets the publish timeout.
        """
        answer = self._answer
        silence = answer.limit
        patience = self._pings.limit
        started = time.monotonic()
        publish = asyncio.ensure_future(self._connected(send))
        ping: asyncio.Future[None] | None = None
        try:
            if answer.known:
                done, _ = await asyncio.wait({publish}, timeout=silence)
                if not done:
                    pinged = time.monotonic()
                    ping = asyncio.ensure_future(self.broker.ping())
                    await asyncio.wait(
                        {publish, ping}, timeout=patience, return_when=asyncio.FIRST_COMPLETED
                    )
                    if ping.done() and ping.exception() is None:
                        self._pings.observe(time.monotonic() - pinged)
                    elif not publish.done():
                        raise _Silent(
                            f"{self._log['target']}: no answer within {silence:.2g} s, nor to "
                            f"a ping within {patience:.2g} s: the path to the broker is silent"
                        )
            left = self.settings.publish_limit - (time.monotonic() - started)
            results = await asyncio.wait_for(asyncio.shield(publish), max(left, 0.0))
        finally:
            # Not awaited: a client stuck on a silent socket may take its time to unwind,
            # and the batch's rows must go back now.
            for task in (publish, ping):
                if task is not None and not task.done():
                    task.cancel()
                    task.add_done_callback(_retrieve)
        if any(r.unreachable for r in results):
            return results
        if answer.known:
            answer.observe(time.monotonic() - started)
        elif self._timing is None or self._timing.done():
            # The first publish on this connection: time a round trip instead, beside the
            # batches (they are not watched until it is known).
            self._timing = asyncio.ensure_future(self._time_ping())
        return results

    async def _time_ping(self) -> None:
        """Measure one ping on the current connection (``router.relay.silence``)."""
        pinged = time.monotonic()
        try:
            await asyncio.wait_for(self.broker.ping(), self.settings.connect_timeout)
        except Exception:  # the next publish will tell
            return
        self._pinged(time.monotonic() - pinged)

    def _pinged(self, seconds: float) -> None:
        """A ping on a new connection answered: it times the pings, and is the publishes'
        first estimate until they are timed themselves."""
        self._pings.observe(seconds)
        if not self._answer.known:
            self._answer.observe(seconds)

    def _unusable(self, messages: list[OutgoingMessage], error: str) -> list[PublishResult]:
        """This host could not use the broker: no verdict on any message. The connection is
        replaced by the next probe."""
        log.warning("broker.unavailable", extra={**self._log, "error": error})
        self.stats.last_error = error
        self._suspect = True
        return [PublishResult.cut_off(error) for _ in messages]


class _Silent(Exception):
    """A publish and a ping went unanswered: the path to the broker is silent."""


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Consume an abandoned task's outcome (so that asyncio does not log it as never read)."""
    if not task.cancelled():
        task.exception()
