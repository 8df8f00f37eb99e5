"""JetStream publish acknowledgements for one connection, on one wildcard inbox.

nats-py's ``JetStreamContext.publish_async`` is not used on the hot path, for two reasons:

- It costs about twice the CPU per message of a plain ``publish`` with a reply subject: a
  semaphore, a random token per message, a ``PubAck`` object (measured with 20,000 messages
  of 600 bytes and ten headers: ~36 µs against ~20 µs per message).
- A JetStream error reply (a message over the stream's ``max_msg_size``, say) raises inside
  its reply handler and never resolves the future, so the publisher waits ``publish_timeout``
  and learns nothing about why.

Here every publish of a connection names ``<inbox>.<n>`` as its reply subject, and one
subscription on ``<inbox>.*`` turns each reply into a ``PublishResult``:

- a PubAck (``{"stream": ..., "seq": ...}``, possibly ``"duplicate": true``): acknowledged;
- status 503, no responders, or a "stream not found" error: no stream captures the subject
  right now (JetStream restarting, the stream deleted or not yet created): retryable, and
  counted in the window's ``no_stream`` so the adapter can look for the stream on that
  failure path alone;
- ``{"error": {"code": 400, ...}}``: JetStream refuses this message as it is: not retryable;
  any other error code: retryable.
- An empty answer: a member of an atomic batch taken in (``STAGED``; only its commit, the
  last member, gets a PubAck). The commit's error 10201 (the batch holds a message id the
  stream stored already) means a batch of the same members was stored before: acknowledged,
  its receipt saying so (``is_batch_stored``). 10176 (the batch is incomplete) is
  retryable: a member did not reach the server, and no member refused says why.

The answers of one window of publishes fill one ``AckWindow``, which completes one future when
the last arrives: no future per message. And on a ``RoutingClient`` the replies reach the
inbox straight from nats-py's protocol parser, without the ``Msg`` object, header parsing,
queue and task nats-py puts in front of a subscription callback (together about a fifth of
the adapter's CPU per message, py-spy on a 100,000-event drain). That hook overrides
``Client._process_msg``, which is not nats-py's public API: where a version lacks it
(``ROUTED`` is False), the inbox subscribes with a callback as any subscriber would.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
from typing import Any

import orjson
from nats.aio.client import Client

from brokers._protocol import PublishResult

__all__ = [
    "NO_STREAM",
    "ROUTED",
    "STAGED",
    "AckInbox",
    "AckWindow",
    "RoutingClient",
    "is_batch_stored",
    "new_client",
]

_NO_RESPONDERS = "503"
_NO_RESPONDERS_LINE = b"NATS/1.0 503"
_STREAM_NOT_FOUND = 10059  # JetStream's err_code for "stream not found"
_BATCH_DUPLICATE = 10201  # "atomic publish batch contains duplicate message id"
_BATCH_INCOMPLETE = 10176  # "atomic publish batch is incomplete"

NO_STREAM = PublishResult.failed(
    "no stream captures the subject (JetStream unavailable, or the stream is missing)",
    retryable=True,
)

STAGED = PublishResult.acked()
"""A member of an atomic batch taken in; the batch's verdict comes with its commit."""


def is_batch_stored(result: PublishResult) -> bool:
    """Whether a batch commit's answer says a batch of the same members was stored before."""
    return result.ok and result.receipt is not None and '"batch_stored":true' in result.receipt


def _routable() -> bool:
    hook = getattr(Client, "_process_msg", None)
    if not callable(hook):
        return False
    names = list(inspect.signature(hook).parameters)
    return names == ["self", "sid", "subject", "reply", "data", "headers"]


ROUTED = _routable()


class RoutingClient(Client):
    """A nats-py client that hands the messages of one subscription to a plain function."""

    def __init__(self) -> None:
        super().__init__()
        self._routed_sid: int | None = None
        self._route: Any = None

    def route(self, subscription: Any, to: Any) -> None:
        """Call ``to(subject, data, headers)`` (raw bytes) for each message of ``subscription``."""
        self._routed_sid, self._route = subscription._id, to

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> None:
        if sid == self._routed_sid:
            self._route(subject, data, headers)
            return
        # nats-py's parser passes None when a message has no headers, whatever the annotation.
        await super()._process_msg(sid, subject, reply, data, headers)  # type: ignore[arg-type]


def new_client() -> Any:
    """A client to ``connect()``: routing acks when this nats-py allows it."""
    return RoutingClient() if ROUTED else Client()


class AckWindow:
    """The answers awaited for one window of publishes, in publish order."""

    __slots__ = ("done", "no_stream", "remaining", "results", "tokens")

    def __init__(self) -> None:
        self.results: list[PublishResult | None] = []
        self.tokens: list[str] = []
        self.remaining = 0
        self.no_stream = 0  # answers that found no stream (each is ``NO_STREAM``)
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()


class AckInbox:
    """Hands out reply subjects and files each answer into its window."""

    def __init__(self) -> None:
        self._prefix = ""
        self._waiting: dict[str, tuple[AckWindow, int]] = {}
        self._tokens = itertools.count(1)

    async def start(self, client: Any) -> None:
        """Subscribe to this connection's reply subjects."""
        self._prefix = client.new_inbox() + "."
        if isinstance(client, RoutingClient):
            # No callback: the client routes these replies before they reach the queue.
            client.route(await client.subscribe(self._prefix + "*"), self._on_routed)
        else:
            await client.subscribe(self._prefix + "*", cb=self._on_reply)

    def expect(self, window: AckWindow) -> str:
        """A fresh reply subject for the next message of ``window``."""
        token = str(next(self._tokens))
        self._waiting[token] = (window, len(window.results))
        window.results.append(None)
        window.tokens.append(token)
        window.remaining += 1
        return self._prefix + token

    def unanswered(self, window: AckWindow) -> None:
        """The next message of ``window`` goes without a reply subject (a member of an atomic
        batch between its first and its commit): taken in as far as this window can tell."""
        window.results.append(STAGED)
        window.tokens.append("")

    def withdraw(self, window: AckWindow) -> None:
        """The last message ``expect`` (or ``unanswered``) was called for is not sent after
        all."""
        token = window.tokens.pop()
        window.results.pop()
        if token:
            del self._waiting[token]
            window.remaining -= 1

    def forget(self, window: AckWindow) -> None:
        """Stop waiting for the window's missing answers (timed out, or connection lost)."""
        for token, result in zip(window.tokens, window.results, strict=True):
            if result is None:
                self._waiting.pop(token, None)

    def _on_routed(self, subject: bytes, data: bytes, headers: bytes | None) -> None:
        no_responders = headers is not None and headers.startswith(_NO_RESPONDERS_LINE)
        self._answer(subject[len(self._prefix) :].decode(), data, no_responders)

    async def _on_reply(self, msg: Any) -> None:
        headers = msg.headers
        no_responders = bool(headers) and headers.get("Status") == _NO_RESPONDERS
        self._answer(msg.subject[len(self._prefix) :], msg.data, no_responders)

    def _answer(self, token: str, data: bytes, no_responders: bool) -> None:
        entry = self._waiting.pop(token, None)
        if entry is None:  # late: its window gave up on it
            return
        window, index = entry
        result = window.results[index] = _outcome(data, no_responders)
        if result is NO_STREAM:
            window.no_stream += 1
        window.remaining -= 1
        if window.remaining == 0 and not window.done.done():
            window.done.set_result(None)


def _outcome(data: bytes, no_responders: bool) -> PublishResult:
    if no_responders:
        return NO_STREAM
    if not data:
        return STAGED
    try:
        answer = orjson.loads(data)
    except orjson.JSONDecodeError:
        return PublishResult.failed(f"unreadable JetStream answer: {data[:80]!r}", retryable=True)
    error = answer.get("error") if isinstance(answer, dict) else None
    if error is None:  # the PubAck itself is the receipt: stream, sequence, duplicate flag
        return PublishResult.acked(data.decode())
    err_code = error.get("err_code")
    if err_code == _STREAM_NOT_FOUND:
        return NO_STREAM
    if err_code == _BATCH_DUPLICATE:
        stream = orjson.dumps(answer.get("stream")).decode()
        return PublishResult.acked(f'{{"stream":{stream},"duplicate":true,"batch_stored":true}}')
    code = error.get("code")
    text = f"{error.get('description', 'error')} (code {code}, err_code {err_code})"
    if code == 400 and err_code != _BATCH_INCOMPLETE:
        return PublishResult.failed(f"rejected by JetStream: {text}", retryable=False)
    return PublishResult.failed(f"JetStream error: {text}", retryable=True)
