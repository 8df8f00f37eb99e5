"""Redis Streams adapter (redis-py's asyncio client).

One ``XADD`` per message to the destination stream (``MAXLEN ~ maxlen`` when set). Redis
answers each XADD with the entry id once the entry is in the stream. An entry's fields depend
on the broker's ``format``:

- ``plain`` (the default), readable by any Redis client (redis-py, ioredis, go-redis):
  ``body`` = the rendered body bytes (the JSON envelope or CloudEvent), then one field per
  transport header (``message-id``, ``event-type``, ``content-type``, ``correlation-id``,
  ...), its value as text. The body wins: a staged header named ``body`` is left out;
- ``faststream`` (the internal broker only): one field ``__data__`` holding FastStream's
  binary frame (``BinaryMessageFormatV1``) of the body and headers, so FastStream
  subscribers read it as they read their own. Only this format imports FastStream.

A batch goes out in waves (no two messages of one stream key in a wave), each wave as one
pipeline: one round trip and one pooled connection for up to ``max_in_flight`` XADDs, which
Redis runs in order. A message that fails holds back the later messages of its stream. (One
connection per XADD in flight ran the client's pool dry under load.)

``publish_atomic`` writes each unit with one Lua script (``brokers.redis._script``), several
units a pipeline (``brokers.redis._units``); each member's receipt is its entry id, as
``publish`` gives. Redis runs a script whole, no other client's command between its commands.
The script first looks for the unit's marker key: a unit sent again after its answer was lost
(a cut connection, a relay killed after Redis stored it) finds the marker its first storing
set, and is acknowledged with the entry ids the marker holds, each receipt saying
``duplicate``: **stored once**, as long as the marker lives (``duplicate_window_seconds``, 120 s
by default; ``router check`` warns when that is shorter than a retry can take).

All or nothing, as far as Redis goes: the script checks every member's key with ``TYPE``
before its first XADD, so a key of the wrong type (a string, a hash) refuses the unit with
nothing stored, the verdict naming the member; a key the user may not write is refused before
the script runs. **A unit can still be stored in part**: a script that fails half-way is not
rolled back, and an XADD can fail after the checks (a stream whose ids are exhausted, which
only a hand-set id near the largest makes). The unit then fails whole (not retryable), naming
the refused member, and its error lists the members Redis stored with their entry ids; a
consumer of those streams sees part of the application's transaction, and again (same
``message-id``) if the rows are requeued.

A user not allowed the script (it needs ``EVALSHA``, ``EVAL``, ``GET``, ``SET``, ``TYPE`` and
the keys ``router:unit:*``), or a server without scripting, gets one warning, and each unit
then goes as ``MULTI``, its XADDs, ``EXEC``, with no marker: a unit sent again after a lost
answer is stored twice, and an XADD that fails when ``EXEC`` runs it (``WRONGTYPE``) fails alone,
the others stored (a transaction does not roll back either). A user allowed XADD but neither
the script nor ``MULTI`` has every XADD run on its own (``brokers.redis._replies`` reads each
case from the replies).

``max_unit`` is 1,000 messages: Redis sets no limit, but it holds a script's arguments (or a
queued transaction) in the connection's memory and runs it without serving any other client,
so a bound keeps one unit from stalling the server for everyone; 1,000 is also JetStream's
batch, so a unit that fits one atomic broker fits the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import redis.exceptions
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.client import Pipeline

from brokers._describe import describe, unreachable
from brokers._lazy import MissingClient, install_hint
from brokers._protocol import OutgoingMessage, PublishResult, unit_too_large
from brokers.ordering import NOT_SENT, waves
from brokers.redis._replies import UNAVAILABLE, classify, receipt
from brokers.redis._settings import BODY_FIELD, FASTSTREAM_CORRELATION, RedisSettings
from brokers.redis._units import Fields, UnitWriter, groups
from envelopes import BrokerUnavailable, WireMessage

__all__ = ["RedisBroker"]

log = logging.getLogger(__name__)

_FASTSTREAM_FIELD = "__data__"  # where FastStream's stream subscribers look for the frame

_Frame = Callable[[WireMessage], Awaitable[Fields]]

# Seconds a pooled connection may sit idle before it is PINGed on its next use.
_HEALTH_CHECK_INTERVAL = 10
_NO_ANSWER: tuple[type[BaseException], ...] = (*UNAVAILABLE, TimeoutError)
_PING_FAILED: tuple[type[BaseException], ...] = (*_NO_ANSWER, redis.exceptions.RedisError)

MAX_UNIT = 1000
"""The most messages one atomic unit holds (see the module docstring)."""


class RedisBroker:
    """Appends to Redis streams; see ``brokers._protocol`` for the contract."""

    kind = "Redis"
    max_unit = MAX_UNIT

    def __init__(self, name: str, settings: RedisSettings) -> None:
        self.name = name
        self.settings = settings
        self._client: Redis | None = None
        # Two batches may publish at once: one connect, which the other waits for.
        self._connecting = asyncio.Lock()
        self._frame = _faststream_frame(settings) if settings.format == "faststream" else None
        self._units = UnitWriter(name, settings, self._fields, self._execute)
        self.duplicate_window: float = settings.duplicate_window_seconds
        """How long a unit sent again is recognised as stored (``router check``)."""

    async def connect(self) -> None:
        """Connect and PING, within connect_timeout."""
        if self._client is not None:
            return
        async with self._connecting:
            if self._client is None:
                self._client = await self._open()
                log.info("broker.connected", extra={"broker": self.name, "kind": self.kind})

    async def _open(self) -> Redis:
        # No retries in the client: a pipeline sent again could append its entries twice;
        # the router retries what failed, with its own backoff.
        pool = ConnectionPool.from_url(
            self.settings.url.get_secret_value(),
            socket_timeout=self.settings.publish_timeout,
            socket_connect_timeout=self.settings.connect_timeout,
            retry_on_error=[],
            # A pooled connection idle this long is PINGed before use, and TCP keepalive is
            # on: a connection that went silent while idle is not trusted with a pipeline.
            health_check_interval=_HEALTH_CHECK_INTERVAL,
            socket_keepalive=True,
        )
        client = Redis.from_pool(pool)
        try:
            await asyncio.wait_for(client.ping(), self.settings.connect_timeout + 1)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                await client.aclose()
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise BrokerUnavailable(
                f"{self.name}: cannot connect to Redis: {unreachable(exc, self.settings)}"
            ) from exc
        return client

    async def _connected(self) -> Redis:
        await self.connect()
        assert self._client is not None  # connect() set it or raised
        return self._client

    async def ping(self) -> None:
        """PING; a failure says why (refused, timed out, refused the password)."""
        client = await self._connected()
        try:
            await asyncio.wait_for(client.ping(), self.settings.connect_timeout)
        except _PING_FAILED as exc:
            raise BrokerUnavailable(
                f"{self.name}: Redis does not answer: {unreachable(exc, self.settings)}"
            ) from exc

    async def close(self) -> None:
        """Close the connection pool; safe to call more than once."""
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.aclose(), 10)

    async def publish(self, batch: Sequence[OutgoingMessage]) -> list[PublishResult]:
        """XADD every message, a pipeline per wave; streams in order."""
        client = await self._connected()
        results: list[PublishResult | None] = [None] * len(batch)
        held: set[str] = set()
        step = self.settings.max_in_flight
        for wave in waves(range(len(batch)), lambda i: batch[i].wire.stream_key):
            for start in range(0, len(wave), step):
                chunk = [i for i in wave[start : start + step] if not self._held(batch[i], held)]
                try:
                    await self._pipeline(client, batch, chunk, results)
                except BrokerUnavailable as exc:
                    await self.close()
                    if not any(r is not None and r.ok for r in results):
                        raise
                    return _fill(results, PublishResult.cut_off(str(exc)))
                for i in chunk:
                    result, key = results[i], batch[i].wire.stream_key
                    if result is not None and not result.ok and result.retryable and key:
                        held.add(key)
        return _fill(results, PublishResult.failed(NOT_SENT, retryable=True))

    @staticmethod
    def _held(message: OutgoingMessage, held: set[str]) -> bool:
        return message.wire.stream_key is not None and message.wire.stream_key in held

    async def _pipeline(
        self,
        client: Redis,
        batch: Sequence[OutgoingMessage],
        chunk: list[int],
        results: list[PublishResult | None],
    ) -> None:
        if not chunk:
            return
        pipe = client.pipeline(transaction=False)
        for i in chunk:
            await self._xadd(pipe, batch[i])
        replies = await self._execute(pipe)
        for i, reply in zip(chunk, replies, strict=True):
            if isinstance(reply, Exception):
                results[i] = classify(reply)
            else:  # XADD answers the entry's id: the receipt, with the stream it is in
                results[i] = PublishResult.acked(receipt(batch[i].destination, reply))

    async def publish_atomic(
        self, units: Sequence[Sequence[OutgoingMessage]]
    ) -> list[list[PublishResult]]:
        """Write each unit once, by its script (MULTI/EXEC for a user without scripting),
        several units a round trip, in order; one verdict per unit
        (``brokers._protocol.AtomicBroker``; what Redis makes of all or nothing: the module
        docstring)."""
        client = await self._connected()
        verdicts = [unit_too_large(u, self.max_unit, "Redis transaction (max_unit)") for u in units]
        pending = [i for i, verdict in enumerate(verdicts) if verdict is None and units[i]]
        answered = False
        for group in groups(units, pending, self.settings.max_in_flight):
            try:
                await self._units.write(client, units, group, verdicts)
            except BrokerUnavailable as exc:
                await self.close()
                if not answered and all(verdicts[i] is None for i in group):
                    raise
                cut = PublishResult.cut_off(str(exc))
                return [v or [cut] * len(u) for v, u in zip(verdicts, units, strict=True)]
            answered = True
        return [v or [] for v in verdicts]  # only an empty unit has no verdict here

    async def _xadd(self, pipe: Pipeline, message: OutgoingMessage) -> None:
        """Queue the message's XADD on ``pipe``, its fields in the broker's format."""
        fields = await self._fields(message.wire)
        pipe.xadd(message.destination, fields, maxlen=self.settings.maxlen, approximate=True)

    async def _fields(self, wire: WireMessage) -> Fields:
        """The entry's fields, in the broker's format."""
        if self._frame is None:
            return _plain_fields(wire.body, self.settings.native_headers(wire))
        return await self._frame(wire)

    async def _execute(self, pipe: Pipeline) -> list[Any]:
        """Send the pipeline; every reply, error replies among them (``BrokerUnavailable``
        when the connection fails or no answer comes within publish_timeout)."""
        try:
            replies: list[Any] = await asyncio.wait_for(
                pipe.execute(raise_on_error=False), self.settings.publish_timeout
            )
        except _NO_ANSWER as exc:
            raise BrokerUnavailable(f"{self.name}: Redis unreachable: {describe(exc)}") from exc
        return replies


def _plain_fields(body: bytes, headers: dict[str, str]) -> Fields:
    """The ``plain`` entry: ``body``, then each header (``native_headers`` left out any
    named ``body``)."""
    fields: Fields = {BODY_FIELD: body}
    fields.update(headers)
    return fields


def _faststream_frame(settings: RedisSettings) -> _Frame:
    """The ``faststream`` entry's encoder; FastStream is imported here, for this format only."""
    try:
        from faststream.redis import BinaryMessageFormatV1
    except ImportError as exc:
        raise MissingClient(install_hint("redis", RedisSettings.extra, exc.name)) from exc

    async def frame(wire: WireMessage) -> Fields:
        headers = settings.native_headers(wire)
        data = await BinaryMessageFormatV1.encode(
            message=wire.body,
            reply_to=None,
            headers=headers,
            correlation_id=headers[FASTSTREAM_CORRELATION],
        )
        return {_FASTSTREAM_FIELD: data}

    return frame


def _fill(results: list[PublishResult | None], missing: PublishResult) -> list[PublishResult]:
    return [r if r is not None else missing for r in results]
