"""NATS JetStream adapter, on nats-py.

Every message of a batch is written at once (up to ``max_in_flight``) with a reply subject of
this connection's ``AckInbox``, and the PubAcks are awaited together: acks in flight, in batch
order on one connection, so JetStream stores them in that order. Two choices keep that order
true when things break:

- The client never reconnects by itself (``allow_reconnect=False``). nats-py would otherwise
  buffer publishes made during a reconnect and flush them on the new connection, where they
  could be stored although earlier messages of the same batch were lost with the old one. A
  lost connection fails every unacknowledged message of the batch at once, and the next batch
  connects again.
- Messages leave in order on one TCP connection, so what the server stored of a batch is
  always a prefix of it; retrying the unacknowledged rest keeps first deliveries in order.
  A batch longer than ``max_in_flight`` goes out in windows on the same connection; once it
  is lost, the rest of the batch is not sent on another.

The stream was checked at connect (it exists and captures the configured subjects), so
messages carry no ``Nats-Expected-Stream`` header: it would cost the client and the server
work on every message to repeat that check. If the stream is deleted while the router runs,
JetStream answers "no responders": only then, on that failure path, the adapter looks for the
stream. With ``stream.create`` on it makes the stream again and sends those messages once
more at once; otherwise (or if that fails) ``publish`` raises ``BrokerUnavailable("stream ...
does not exist ...")``, which opens the target's circuit instead of spending every row's
attempts, and the circuit's probe (a connect) finds the stream once it is back.

With ``stream.allow_atomic``, ``publish_atomic`` writes each unit as one JetStream atomic batch
(ADR-50, nats-server 2.12+): every member carries ``Nats-Batch-Id`` (new for each attempt) and
``Nats-Batch-Sequence``, the last also ``Nats-Batch-Commit``, and each is sent with a reply
subject, so a member the stream refuses is named by its own answer. The commit's PubAck gives
the last member's sequence and the count: the members hold the sequences before it, in order.
A unit sent again after its commit's answer was lost is refused whole with error 10201 (its
``Nats-Msg-Id``s are in the stream's duplicate window): stored already, so acknowledged.

A message NATS cannot carry as it is (a header name outside the token characters, or over the
server's ``max_payload``) is refused on its own, not retried; the rest of the batch still goes
(see ``brokers.nats._frames``).

This adapter talks to nats-py directly rather than through FastStream: FastStream's connect
retries and reconnects on its own, and its ``publish`` awaits each ack in turn (about twice
the CPU per message, and no acks in flight). Acks are matched by ``AckInbox`` rather than
nats-py's ``publish_async`` (see ``brokers.nats._acks`` for why).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Sequence
from typing import Any

import nats
import nats.errors
import nats.js.errors
import orjson
from nats.js.api import StorageType, StreamConfig

from brokers._describe import describe
from brokers._protocol import (
    OutgoingMessage,
    PublishResult,
    member_refused,
    unit_too_large,
    unit_verdict,
)
from brokers.nats import _frames
from brokers.nats._acks import NO_STREAM, AckInbox, AckWindow, is_batch_stored, new_client
from brokers.nats._settings import (
    BATCH_COMMIT,
    BATCH_ID,
    BATCH_SEQUENCE,
    MSG_ID_HEADER,
    NatsSettings,
    subject_matches,
)
from envelopes import BrokerError, BrokerUnavailable, MissingDestination

__all__ = ["MSG_ID_HEADER", "NatsBroker"]

log = logging.getLogger(__name__)

# Failures that mean "the connection is not usable": nothing unacknowledged counts as sent.
_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.ConnectionDrainingError,
    nats.errors.NoServersError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.UnexpectedEOF,
    ConnectionError,
    OSError,
)
_ANSWER_ERRORS: tuple[type[BaseException], ...] = (
    TimeoutError,
    nats.errors.Error,
    *_CONNECTION_ERRORS,
)


# Seconds between nats-py's keepalive pings (see connect()).
_PING_INTERVAL = 10

# The most members one batch may hold (ADR-50).
MAX_BATCH = 1000


class _MemberRefused(Exception):
    """A member of an atomic unit cannot go as it is: the whole unit stays."""

    def __init__(self, position: int, reason: str) -> None:
        super().__init__(reason)
        self.position, self.reason = position, reason


class NatsBroker:
    """Publishes to one JetStream stream; see ``brokers._protocol`` for the contract."""

    max_unit = MAX_BATCH

    def __init__(self, name: str, settings: NatsSettings) -> None:
        self.name = name
        self.settings = settings
        self._client: Any = None
        self._js: Any = None
        self._acks = AckInbox()
        self._closed = asyncio.Event()
        # The processor publishes two batches at once: the second must wait for the first's
        # connect to finish (stream created or checked), not publish on a half-made client.
        self._connecting = asyncio.Lock()
        self.duplicate_window: float | None = None
        """Seconds the stream drops a repeated ``Nats-Msg-Id`` for, once connected (as found,
        or as created): how long a unit sent again is recognised as stored (``router
        check`` compares it with the retry horizon of an atomic target)."""

    async def connect(self) -> None:
        """Connect and create (or check) the stream."""
        if self._connected():
            return
        async with self._connecting:
            if not self._connected():
                await self._connect()

    def _connected(self) -> bool:
        return self._client is not None and not self._client.is_closed

    async def _connect(self) -> None:
        errors: list[BaseException] = []
        closed = asyncio.Event()

        async def remember(error: BaseException) -> None:
            errors.append(error)

        async def on_closed() -> None:
            closed.set()

        client = new_client()
        try:
            await asyncio.wait_for(
                client.connect(
                    self.settings.servers(),
                    connect_timeout=self.settings.connect_timeout,
                    allow_reconnect=False,
                    # nats-py tries each server until this is exhausted even when it may not
                    # reconnect; two quick tries, then the real reason.
                    max_reconnect_attempts=1,
                    reconnect_time_wait=0.1,
                    error_cb=remember,
                    closed_cb=on_closed,
                    name=f"outbox-router:{self.name}",
                    # nats-py pings every 2 minutes and gives up after 2 missed pongs: an idle
                    # connection gone silent would be trusted for 4 minutes. 10 s x 2 here; a
                    # publish finds a silent path sooner anyway (silence_timeout).
                    ping_interval=_PING_INTERVAL,
                    max_outstanding_pings=2,
                ),
                self.settings.connect_timeout + 1,
            )
        except _ANSWER_ERRORS as exc:
            reason = describe(errors[-1]) if errors else describe(exc)
            raise BrokerUnavailable(f"{self.name}: cannot connect to NATS: {reason}") from exc
        js = client.jetstream(timeout=self.settings.publish_timeout)
        acks = AckInbox()
        try:
            await acks.start(client)
            await self._ensure_stream(js)
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), 5)
            raise
        # Usable only now: publish() sees a client only once its stream is there.
        self._client, self._js, self._acks, self._closed = client, js, acks, closed
        log.info("nats.connected", extra={"broker": self.name})

    async def publish(self, batch: Sequence[OutgoingMessage]) -> list[PublishResult]:
        """Publish all messages with acks in flight; one result per message, in order."""
        await self.connect()
        client = self._client
        step = self.settings.max_in_flight
        results: list[PublishResult] = []
        for start in range(0, len(batch), step):
            if self._client is not client:  # lost in an earlier window: not on another one
                lost = PublishResult.cut_off("NATS connection lost before sending")
                results.extend(lost for _ in batch[start:])
                break
            try:
                results.extend(await self._publish_window(batch[start : start + step]))
            except BrokerUnavailable as exc:
                if not any(r.ok for r in results):
                    raise
                results.extend(PublishResult.cut_off(str(exc)) for _ in batch[start:])
                break
        return results

    async def _publish_window(
        self, window: Sequence[OutgoingMessage], *, recover: bool = True
    ) -> list[PublishResult]:
        client, acks = self._client, self._acks
        refused: dict[int, PublishResult] = {}
        frames: list[bytes] = []
        sent: list[tuple[OutgoingMessage, dict[str, str], str]] = []
        answers = AckWindow()
        native_headers = self.settings.native_headers
        for index, message in enumerate(window):
            headers = native_headers(message.wire)
            reply = acks.expect(answers)
            try:
                data = _frames.frame(
                    message.destination, reply, headers, message.wire.body, client.max_payload
                )
            except _frames.Refused as exc:
                # Refused for good, so it does not hold back its stream: the rest still go.
                acks.withdraw(answers)
                refused[index] = PublishResult.failed(str(exc), retryable=False)
                continue
            frames.append(data)
            sent.append((message, headers, reply))
        try:
            if _frames.FRAMES:
                await _frames.send(client, frames)
            else:
                for message, headers, reply in sent:
                    await client.publish(
                        message.destination, message.wire.body, reply=reply, headers=headers
                    )
        except _CONNECTION_ERRORS as exc:
            acks.forget(answers)
            await self.close()
            raise BrokerUnavailable(f"{self.name}: NATS connection lost: {describe(exc)}") from exc
        results = iter(await self._collect(answers))
        outcome = [refused[i] if i in refused else next(results) for i in range(len(window))]
        if answers.no_stream and recover:
            return await self._resend_without_stream(window, outcome)
        return outcome

    async def publish_atomic(
        self, units: Sequence[Sequence[OutgoingMessage]]
    ) -> list[list[PublishResult]]:
        """Publish the units with one verdict each (``brokers._protocol.AtomicBroker``).

        Consecutive units go together in one JetStream batch of up to ``MAX_BATCH``
        messages: an R1 file-backed stream syncs its store at each batch's commit, a few
        milliseconds, so a batch per unit would cap a target at a few hundred units a second.
        A batch of several units stores all of them or none, so none is seen in part; when it
        is refused (a member refused, or one of its units stored before: error 10201), each
        of its units is sent again in a batch of its own, for its own verdict (``_batches``)."""
        await self.connect()
        verdicts: list[list[PublishResult] | None] = [
            unit_too_large(unit, MAX_BATCH, "JetStream batch") for unit in units
        ]
        pending = [i for i, verdict in enumerate(verdicts) if verdict is None and units[i]]
        again = await self._batches(units, _packs(units, pending), verdicts)
        if again:
            await self._batches(units, [[i] for i in again], verdicts, every=True)
        return [verdict or [] for verdict in verdicts]

    async def _batches(
        self,
        units: Sequence[Sequence[OutgoingMessage]],
        packs: list[list[int]],
        verdicts: list[list[PublishResult] | None],
        every: bool = False,
    ) -> list[int]:
        """Send each pack of units (indexes into ``units``) as one batch, answers in flight,
        and fill ``verdicts``; the units to send again, one batch each and every member
        answered (``every``): those of a batch that was refused. Only the first and the last
        member of a batch are sent as requests, unless ``every``: an answer per member halves
        what JetStream stores a second, and a member refused without one is named by no
        answer (the commit says only that the batch is incomplete), so a refused batch is
        sent again for the names."""
        client, acks = self._client, self._acks
        answers = AckWindow()
        frames: list[bytes] = []
        sent: list[tuple[int, list[int], str]] = []  # per batch: its answers' start, units, id
        for pack in packs:
            while pack:
                start, batch = len(answers.results), uuid.uuid4().hex
                members = [message for i in pack for message in units[i]]
                try:
                    frames.extend(self._batch_frames(members, batch, answers, every))
                except _MemberRefused as exc:
                    while len(answers.results) > start:
                        acks.withdraw(answers)
                    owner, position = _owner(units, pack, exc.position)
                    ids = [m.wire.message_id for m in units[owner]]
                    verdicts[owner] = member_refused(ids, position, exc.reason, retryable=False)
                    pack = [i for i in pack if i != owner]
                    continue
                sent.append((start, pack, batch))
                break
        if not frames:
            return []
        try:
            await self._send(client, frames)
        except BrokerUnavailable:
            acks.forget(answers)
            raise
        results = await self._collect(answers)
        again: list[int] = []
        for start, pack, batch in sent:
            members = [message for i in pack for message in units[i]]
            outcome = self._unit_outcome(members, results[start : start + len(members)], batch)
            whole = all(r.ok for r in outcome) and not is_batch_stored(outcome[0])
            named = every or (len(pack) == 1 and is_batch_stored(outcome[0]))
            if not whole and not named and not any(r.unreachable for r in outcome):
                again.extend(pack)
                continue
            at = 0
            for i in pack:
                verdicts[i] = outcome[at : at + len(units[i])]
                at += len(units[i])
        return again

    def _batch_frames(
        self, unit: Sequence[OutgoingMessage], batch: str, answers: AckWindow, every: bool
    ) -> list[bytes]:
        """The batch's frames; ``_MemberRefused`` names a member that cannot go as it is (a
        header name, its size). The first and the last (the commit) are sent as requests;
        the others too with ``every``, each then answered on its own."""
        frames = []
        last = len(unit)
        max_payload = self._client.max_payload
        for number, message in enumerate(unit, 1):
            headers = dict(self.settings.native_headers(message.wire))
            headers[BATCH_ID] = batch
            headers[BATCH_SEQUENCE] = str(number)
            if number == last:
                headers[BATCH_COMMIT] = "1"
            if every or number in (1, last):
                reply = self._acks.expect(answers)
            else:
                reply = ""
                self._acks.unanswered(answers)
            try:
                body = message.wire.body
                frames.append(_frames.frame(message.destination, reply, headers, body, max_payload))
            except _frames.Refused as exc:
                raise _MemberRefused(number - 1, str(exc)) from None
        return frames

    def _unit_outcome(
        self, unit: Sequence[OutgoingMessage], members: list[PublishResult], batch: str
    ) -> list[PublishResult]:
        """One verdict from the members' answers; on success each member's receipt."""
        ids = [m.wire.message_id for m in unit]
        commit = members[-1]
        if not all(r.ok for r in members) or commit.receipt is None:
            return unit_verdict(members, ids)
        if is_batch_stored(commit):
            return [commit] * len(unit)
        ack = orjson.loads(commit.receipt)
        if ack.get("batch") != batch or ack.get("count") != len(unit):
            # A server without atomic publish stored each member on its own: say so loudly.
            refusal = PublishResult.failed(
                "JetStream answered the batch's commit without the batch "
                f"({commit.receipt}): atomic publish needs nats-server 2.12 or later and "
                "a stream with allow_atomic",
                retryable=False,
            )
            return [refusal] * len(unit)
        first = ack["seq"] - len(unit) + 1
        # A receipt per member, formatted: a JSON encoder per member cost a seventh of the
        # relay's CPU on a drain of transactions of three (the stream's name comes encoded).
        head = '{"stream":' + orjson.dumps(ack["stream"]).decode() + ',"seq":'
        tail = f',"batch":"{batch}","count":{len(unit)}}}'
        return [PublishResult.acked(f"{head}{first + i}{tail}") for i in range(len(unit))]

    async def _send(self, client: Any, frames: list[bytes]) -> None:
        """Write frames in order; ``BrokerUnavailable`` (the connection closed) if that fails."""
        try:
            await _frames.send(client, frames)
        except _CONNECTION_ERRORS as exc:
            await self.close()
            raise BrokerUnavailable(f"{self.name}: NATS connection lost: {describe(exc)}") from exc

    async def _resend_without_stream(
        self, window: Sequence[OutgoingMessage], outcome: list[PublishResult]
    ) -> list[PublishResult]:
        """Some messages found no stream: make sure it exists (re-created if it was deleted
        and stream.create allows), then send those messages once more."""
        again = [i for i, result in enumerate(outcome) if result is NO_STREAM]
        try:
            await self._restore_stream()
            retried = await self._publish_window([window[i] for i in again], recover=False)
        except BrokerError as exc:
            if any(result.ok for result in outcome):
                return outcome  # what was acknowledged stays so; the rest waits for a retry
            if isinstance(exc, BrokerUnavailable):
                raise
            raise BrokerUnavailable(str(exc)) from exc
        # Those messages were not stored, and a window never holds two messages of one stream
        # key (the delivery sends waves), so sending them now is what a retry would do, sooner.
        for i, result in zip(again, retried, strict=True):
            outcome[i] = result
        return outcome

    async def _restore_stream(self) -> None:
        """Check the stream again, creating it if it is missing and stream.create is on."""
        async with self._connecting:  # one batch re-creates it; a concurrent one finds it
            if not self._connected():
                raise BrokerUnavailable(f"{self.name}: NATS connection closed")
            name = self.settings.stream.name
            try:
                # Bounded like a connect, so that this and the resend fit in publish_limit.
                async with asyncio.timeout(self.settings.connect_timeout):
                    created = await self._ensure_stream(self._js)
            except TimeoutError:
                raise BrokerUnavailable(
                    f"{self.name}: JetStream did not answer about stream {name!r}"
                ) from None
        if created:
            log.warning("nats.stream.recreated", extra={"broker": self.name, "stream": name})

    async def ping(self) -> None:
        """Round-trip to the server (JetStream account info)."""
        await self.connect()
        try:
            await asyncio.wait_for(self._js.account_info(), self.settings.connect_timeout)
        except _ANSWER_ERRORS as exc:
            raise BrokerUnavailable(f"{self.name}: NATS does not answer: {describe(exc)}") from exc

    async def close(self) -> None:
        """Close the connection."""
        client, self._client, self._js = self._client, None, None
        if client is not None and not client.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), 5)

    async def _collect(self, answers: AckWindow) -> list[PublishResult]:
        """Wait for every ack, the connection to close, or publish_timeout: whichever first."""
        if not answers.results:  # every message of the window was refused
            return []
        if answers.remaining:
            closed: asyncio.Future[Any] = asyncio.ensure_future(self._closed.wait())
            try:
                await asyncio.wait(
                    [answers.done, closed],
                    timeout=self.settings.publish_timeout,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                closed.cancel()
                self._acks.forget(answers)  # also when cancelled: nothing is left waiting
        lost = self._closed.is_set()
        if lost:
            await self.close()
        reason = "NATS connection lost before the ack" if lost else "no ack within publish_timeout"
        unanswered = PublishResult.cut_off(reason)
        results = [unanswered if r is None else r for r in answers.results]
        if lost and not any(r.ok for r in results):
            raise BrokerUnavailable(f"{self.name}: {reason}")
        return results

    async def _ensure_stream(self, js: Any) -> bool:
        """Create the stream if it is missing (and allowed), else check its subjects; True if
        it was created."""
        wanted = self.settings.stream
        try:
            info = await js.stream_info(wanted.name)
        except nats.js.errors.NotFoundError:
            if not wanted.create:
                raise MissingDestination(
                    f"{self.name}: stream {wanted.name!r} does not exist and stream.create is off"
                ) from None
            try:
                await js.add_stream(
                    StreamConfig(
                        name=wanted.name,
                        subjects=list(wanted.subjects),
                        storage=StorageType(wanted.storage),
                        num_replicas=wanted.replicas,
                        max_age=wanted.max_age_seconds,
                        duplicate_window=wanted.duplicate_window_seconds,
                        allow_atomic=wanted.allow_atomic or self.settings.atomic or None,
                    )
                )
            except nats.js.errors.APIError as exc:
                raise BrokerError(
                    f"{self.name}: cannot create stream {wanted.name!r}: {exc.description}"
                ) from exc
            log.info("nats.stream.created", extra={"broker": self.name, "stream": wanted.name})
            self.duplicate_window = wanted.duplicate_window_seconds
            return True
        except _ANSWER_ERRORS as exc:
            raise BrokerUnavailable(
                f"{self.name}: cannot read stream {wanted.name!r}: {describe(exc)}"
            ) from exc
        self.duplicate_window = info.config.duplicate_window
        have = list(info.config.subjects or [])
        missing = [s for s in wanted.subjects if not any(subject_matches(h, s) for h in have)]
        if missing:
            raise BrokerError(
                f"{self.name}: stream {wanted.name!r} exists with subjects {have}, "
                f"which do not cover {missing}"
            )
        if (wanted.allow_atomic or self.settings.atomic) and not info.config.allow_atomic:
            why = "atomic is on" if self.settings.atomic else "stream.allow_atomic is on"
            raise BrokerError(
                f"{self.name}: stream {wanted.name!r} does not allow atomic batch publish "
                f"({why}): allow it on the stream (allow_atomic, nats-server 2.12 or later)"
            )
        return False


def _packs(units: Sequence[Sequence[OutgoingMessage]], indexes: list[int]) -> list[list[int]]:
    """Consecutive units, as many as fit one batch (``MAX_BATCH`` messages) each."""
    packs: list[list[int]] = []
    size = MAX_BATCH
    for i in indexes:
        if size + len(units[i]) > MAX_BATCH:
            packs.append([])
            size = 0
        packs[-1].append(i)
        size += len(units[i])
    return packs


def _owner(
    units: Sequence[Sequence[OutgoingMessage]], pack: list[int], position: int
) -> tuple[int, int]:
    """The unit of ``pack`` holding its batch's member at ``position``, and the member's place
    in that unit."""
    for i in pack:
        if position < len(units[i]):
            return i, position
        position -= len(units[i])
    raise IndexError(position)
