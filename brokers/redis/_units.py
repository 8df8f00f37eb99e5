"""Atomic units on Redis: each written by its script (``brokers.redis._script``), which
stores a unit once however often it is sent, or by ``MULTI``/``EXEC`` for a user or server
without scripting.

Several units go in one pipeline (one round trip, up to ``max_in_flight`` XADDs; a larger unit
goes alone), in order on one connection: one ``EVALSHA`` per unit, or ``MULTI``, its XADDs,
``EXEC``. They go as plain commands, not through redis-py's ``Script`` or transaction pipeline:
the first loads scripts with ``SCRIPT EXISTS``/``SCRIPT LOAD`` before each pipeline; the second
holds one transaction per round trip and, when ``EXEC`` discards it, raises the first queued
error only, its member named in the text alone.

A unit whose ``EVALSHA`` Redis answers ``NOSCRIPT`` (a restarted server, ``SCRIPT FLUSH``) goes
again by ``EVAL``, which caches the script. A unit whose script Redis refuses for good
(``NOPERM`` to the command, no scripting, ``GET`` or ``TYPE`` refused inside it) goes by
``MULTI``/``EXEC``, and so does every later unit of the broker for ``SCRIPT_RETRY_SECONDS``,
when a unit tries the script again (an operator may have granted it since; a log says when it
runs again): one warning (``redis.unit_script.unavailable``) says what to grant. ``NOPERM``
for a key does not say which: the unit goes by ``MULTI``/``EXEC`` for its verdict, and if
that stores it, the key refused was its marker's, and the broker stops scripting too. A
refused script stored nothing, so going again stores nothing twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import NoScriptError
from redis.typing import EncodableT, FieldT

from brokers._describe import describe
from brokers._protocol import OutgoingMessage, PublishResult, whole_unit
from brokers.redis._replies import (
    classify,
    keys_denied,
    script_outcome,
    scripting_refused,
    unit_outcome,
    unmarked,
)
from brokers.redis._script import SCRIPT, SCRIPT_GRANTS, SHA, marker_key, script_arguments
from brokers.redis._settings import RedisSettings
from envelopes import WireMessage

__all__ = ["Fields", "UnitWriter", "groups"]

log = logging.getLogger(__name__)

SCRIPT_RETRY_SECONDS = 300.0
"""How long after Redis refused the script a broker's units go by ``MULTI``/``EXEC`` before
one tries the script again: a grant takes effect without a restart of the relay."""

Fields = dict[FieldT, EncodableT]
"""An entry's fields, as XADD takes them."""
Verdicts = list[list[PublishResult] | None]
"""Per unit of a call, its verdict once known."""


class UnitWriter:
    """Writes one broker's atomic units: by script while Redis runs it, else MULTI/EXEC."""

    def __init__(
        self,
        broker: str,
        settings: RedisSettings,
        fields: Callable[[WireMessage], Awaitable[Fields]],
        send: Callable[[Pipeline], Awaitable[list[Any]]],
    ) -> None:
        """``fields``: an entry's fields in the broker's format; ``send``: execute a
        pipeline, every reply (raising ``BrokerUnavailable`` when none comes)."""
        self.broker = broker
        self.settings = settings
        self._fields = fields
        self._send = send
        self.scripted = True
        """Whether units go by script (until Redis shows it cannot run one; tried again
        ``SCRIPT_RETRY_SECONDS`` after that)."""
        self._retry_at: float | None = None
        self._warned = False

    async def write(
        self,
        client: Redis,
        units: Sequence[Sequence[OutgoingMessage]],
        group: list[int],
        verdicts: Verdicts,
    ) -> None:
        """Write the units of ``group`` (one pipeline's worth) and set their verdicts."""
        retrying = self._retry_at is not None and time.monotonic() >= self._retry_at
        if retrying:
            self.scripted, self._retry_at = True, None
        if not self.scripted:
            await self._transactions(client, units, group, verdicts)
            return
        await self._scripts(client, units, group, verdicts)
        if retrying and self.scripted:
            log.info("redis.unit_script.available", extra={"broker": self.broker})

    async def _scripts(
        self,
        client: Redis,
        units: Sequence[Sequence[OutgoingMessage]],
        group: list[int],
        verdicts: Verdicts,
    ) -> None:
        """One pipeline of ``EVALSHA`` per unit of ``group``; their verdicts. Units the
        server had not cached the script for go again by ``EVAL``; units whose script could
        not run (not allowed, no scripting) by ``MULTI``/``EXEC``."""
        arguments = {i: await self._script_arguments(units[i]) for i in group}
        refused = await self._run_scripts(client, units, group, arguments, verdicts, cached=True)
        uncached = [i for i, exc in refused.items() if isinstance(exc, NoScriptError)]
        if uncached:
            for i in uncached:
                del refused[i]
            refused |= await self._run_scripts(
                client, units, uncached, arguments, verdicts, cached=False
            )
        if refused:
            await self._without_script(client, units, refused, verdicts)

    async def _run_scripts(
        self,
        client: Redis,
        units: Sequence[Sequence[OutgoingMessage]],
        chosen: list[int],
        arguments: dict[int, list[EncodableT]],
        verdicts: Verdicts,
        *,
        cached: bool,
    ) -> dict[int, Exception]:
        """Run the script for each unit of ``chosen`` (by its SHA when ``cached``, else by
        its text) in one pipeline; the units it could not run for, with the error."""
        pipe = client.pipeline(transaction=False)
        for i in chosen:
            if cached:
                pipe.execute_command("EVALSHA", SHA, *arguments[i])
            else:
                pipe.execute_command("EVAL", SCRIPT, *arguments[i])
        refused: dict[int, Exception] = {}
        for i, answer in zip(chosen, await self._send(pipe), strict=True):
            if isinstance(answer, Exception):
                if scripting_refused(answer):
                    refused[i] = answer
                else:
                    verdicts[i] = whole_unit(len(units[i]), classify(answer))
                continue
            verdicts[i] = script_outcome(units[i], answer)
            why = unmarked(answer)
            if why is not None:
                self._script_off(f"the unit was stored, but not its marker: {why}")
        return refused

    async def _without_script(
        self,
        client: Redis,
        units: Sequence[Sequence[OutgoingMessage]],
        refused: dict[int, Exception],
        verdicts: Verdicts,
    ) -> None:
        """Write the units whose script Redis refused by ``MULTI``/``EXEC`` (the script stored
        nothing of them). Refused for a key, a unit so stored shows the key refused was its
        marker's; refused for the script itself, no later unit tries it."""
        group = sorted(refused)
        for exc in refused.values():
            if not keys_denied(exc):
                self._script_off(describe(exc))
                break
        await self._transactions(client, units, group, verdicts)
        stored = [i for i in group if _stored(verdicts[i])]
        if stored:
            # It may write the unit's streams: the key it may not is the marker.
            self._script_off(f"{describe(refused[stored[0]])}: the unit's marker")

    def _script_off(self, why: str) -> None:
        """Write later units by MULTI/EXEC, and say once what that costs and how to avoid it;
        try the script again ``SCRIPT_RETRY_SECONDS`` later (an operator may grant it)."""
        if not self.scripted:
            return
        self.scripted = False
        self._retry_at = time.monotonic() + SCRIPT_RETRY_SECONDS
        if self._warned:  # still refused on a retry: said already
            log.debug("redis.unit_script.still_unavailable", extra={"broker": self.broker})
            return
        self._warned = True
        log.warning(
            "redis.unit_script.unavailable",
            extra={
                "broker": self.broker,
                "reason": why,
                "grant": SCRIPT_GRANTS,
                "consequence": "atomic units go as MULTI/EXEC: a unit sent again after its "
                "answer was lost (a cut connection, a killed relay) is stored twice",
            },
        )

    async def _script_arguments(self, unit: Sequence[OutgoingMessage]) -> list[EncodableT]:
        entries = [await self._fields(message.wire) for message in unit]
        return script_arguments(
            marker_key(self.broker, unit),
            unit,
            entries,
            window=self.settings.duplicate_window_seconds,
            maxlen=self.settings.maxlen,
        )

    async def _transactions(
        self,
        client: Redis,
        units: Sequence[Sequence[OutgoingMessage]],
        group: list[int],
        verdicts: Verdicts,
    ) -> None:
        """One pipeline of ``MULTI``, XADDs, ``EXEC`` per unit of ``group``; their verdicts."""
        pipe = client.pipeline(transaction=False)
        for i in group:
            pipe.execute_command("MULTI")
            for message in units[i]:
                await self._xadd(pipe, message)
            pipe.execute_command("EXEC")
        replies = await self._send(pipe)
        start = 0
        for i in group:
            end = start + len(units[i]) + 2
            verdicts[i] = unit_outcome(units[i], replies[start:end])
            start = end

    async def _xadd(self, pipe: Pipeline, message: OutgoingMessage) -> None:
        fields = await self._fields(message.wire)
        pipe.xadd(message.destination, fields, maxlen=self.settings.maxlen, approximate=True)


def groups(
    units: Sequence[Sequence[OutgoingMessage]], pending: list[int], step: int
) -> Iterator[list[int]]:
    """The units of ``pending`` in order, a group per pipeline of at most ``step`` XADDs
    (a larger unit alone): a unit is never split."""
    group: list[int] = []
    size = 0
    for i in pending:
        if group and size + len(units[i]) > step:
            yield group
            group, size = [], 0
        group.append(i)
        size += len(units[i])
    if group:
        yield group


def _stored(verdict: list[PublishResult] | None) -> bool:
    return verdict is not None and bool(verdict) and verdict[0].ok
