"""A small Azure Service Bus peer: just enough AMQP 1.0 for the unchanged azure-servicebus SDK
to send to it, so the Service Bus adapter is tested over a real AMQP connection.

    python -m tests.peers.servicebus --port 5673

Connection string for it::

    Endpoint=sb://localhost:5673;SharedAccessKeyName=x;SharedAccessKey=y;UseDevelopmentEmulator=true;

What it does (and all it does):

- accepts plain AMQP with SASL ANONYMOUS (``UseDevelopmentEmulator=true`` turns TLS off);
- answers every token put on the ``$cbs`` node with status 202, ``correlation_id`` set to the
  request's ``message_id``, as Service Bus does for a valid SAS token;
- accepts transfers on any address and keeps the messages per address, unpacking the SDK's
  batch format (one transfer wrapping several encoded messages);
- rejects transfers to addresses in ``reject`` with ``amqp:not-found`` and an info map (the
  SDK hangs until its timeout on a rejection without one).

It proves the adapter drives the real SDK over a real AMQP 1.0 connection; it does not
model Azure's server-side features (sessions, duplicate detection, scheduling).
"""

from __future__ import annotations

import argparse
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from proton import Condition, Data, Delivery, Link, Message, symbol
from proton.handlers import MessagingHandler
from proton.reactor import Container

CONNECTION_STRING = (
    "Endpoint=sb://localhost:{port};SharedAccessKeyName=x;SharedAccessKey=y;"
    "UseDevelopmentEmulator=true;"
)
_BATCH_FORMAT = 0x80013700


@dataclass(frozen=True)
class Received:
    """One message as the peer stored it."""

    address: str
    body: bytes
    message_id: str | None
    correlation_id: str | None
    subject: str | None
    content_type: str | None
    session_id: str | None
    properties: dict[str, Any]


class _Handler(MessagingHandler):
    def __init__(self, peer: ServiceBusPeer) -> None:
        super().__init__(prefetch=100, auto_accept=False, auto_settle=True)
        self.peer = peer
        self.acceptor: Any = None

    def on_start(self, event: Any) -> None:
        self.acceptor = event.container.listen(f"{self.peer.host}:{self.peer.port}")
        self.peer.ready.set()

    def on_connection_opening(self, event: Any) -> None:
        event.connection.container = "servicebus-peer"

    def on_link_opening(self, event: Any) -> None:
        link = event.link
        if link.is_sender:
            link.source.address = link.remote_source.address
        else:
            link.target.address = link.remote_target.address
        link.open()

    def on_link_closing(self, event: Any) -> None:
        event.link.close()

    def on_delivery(self, event: Any) -> None:
        link: Link = event.link
        delivery: Delivery = event.delivery
        # MessagingHandler's own child handlers see every delivery too: they settle what we
        # send ($cbs answers); we take the raw bytes of what we receive, to unpack batches.
        if link.is_sender or not delivery.readable or delivery.partial:
            return
        raw = link.recv(delivery.pending)
        link.advance()
        self._received(link, delivery, raw)

    def _received(self, link: Link, delivery: Delivery, raw: bytes) -> None:
        address = _entity(link.remote_target.address or link.target.address)
        message = Message()
        message.decode(raw)
        if address == "$cbs":
            self._answer_token(link.connection, message)
            self.accept(delivery)
            return
        if address in self.peer.reject:
            delivery.local.condition = Condition(
                "amqp:not-found",
                f"The messaging entity '{address}' could not be found.",
                {symbol("tracking-id"): "peer", symbol("error-context"): "peer"},
            )
            delivery.update(Delivery.REJECTED)
            delivery.settle()
            return
        for inner in _unpack(raw, message):
            self.peer.store(address, inner)
        self.accept(delivery)

    def _answer_token(self, connection: Any, request: Message) -> None:
        # The SDK sends no reply_to: the answer goes back on its receiving link to $cbs.
        reply_to = request.reply_to or "$cbs"
        reply = Message(
            address=reply_to,
            correlation_id=request.id,
            properties={"status-code": 202, "status-description": "Accepted"},
        )
        link = connection.link_head(0)
        while link is not None:
            if link.is_sender and link.source.address == reply_to:
                link.send(reply)
                return
            link = link.next(0)


def _entity(address: str | None) -> str:
    """The SDK addresses entities as amqps://host:port/<entity>; keep the entity path."""
    if not address:
        return ""
    if "://" in address:
        return urlsplit(address).path.lstrip("/")
    return address


def _unpack(raw: bytes, message: Message) -> list[Message]:
    """The SDK sends a list or batch as one transfer whose data sections each hold one whole
    encoded message; a plain message is returned as it is."""
    inner = [bytes(value) for descriptor, value in _sections(raw) if descriptor == 0x75]
    if len(inner) < 1 or not all(_is_message(part) for part in inner):
        return [message]
    messages = []
    for encoded in inner:
        decoded = Message()
        decoded.decode(encoded)
        messages.append(decoded)
    return messages


def _sections(raw: bytes) -> list[tuple[int, Any]]:
    """The described sections (descriptor, value) an encoded AMQP message is made of."""
    sections: list[tuple[int, Any]] = []
    offset = 0
    while offset < len(raw):
        data = Data()
        used = data.decode(raw[offset:])
        if used <= 0:
            break
        offset += used
        data.rewind()
        if data.next() == Data.DESCRIBED:
            data.enter()
            data.next()
            descriptor = int(data.get_ulong())
            data.next()
            value = data.get_object()
            # A memoryview points into the decoder's buffer, which goes with it: copy now.
            sections.append((descriptor, bytes(value) if isinstance(value, memoryview) else value))
            data.exit()
    return sections


def _is_message(encoded: bytes) -> bool:
    # An encoded message starts with a described section: 0x00 0x53 then 0x70..0x77.
    return (
        len(encoded) > 3
        and encoded[0] == 0x00
        and encoded[1] == 0x53
        and 0x70 <= encoded[2] <= 0x77
    )


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _body(message: Message) -> bytes:
    body = message.body
    if isinstance(body, memoryview):
        return body.tobytes()
    if isinstance(body, bytes):
        return body
    if isinstance(body, list):  # a list of data sections
        return b"".join(bytes(part) for part in body)
    return str(body).encode()


class ServiceBusPeer:
    """The peer, run on a background thread; ``messages(address)`` shows what arrived."""

    def __init__(self, host: str = "127.0.0.1", port: int = 5673) -> None:
        self.host = host
        self.port = port
        self.reject: set[str] = set()
        self.ready = threading.Event()
        self._received: dict[str, list[Received]] = defaultdict(list)
        self._lock = threading.Lock()
        self._container: Container | None = None
        self._thread: threading.Thread | None = None
        self._handler: _Handler | None = None

    @property
    def connection_string(self) -> str:
        """What the SDK needs to reach this peer."""
        return CONNECTION_STRING.format(port=self.port)

    def start(self) -> None:
        """Listen on host:port in a background thread."""
        self.ready.clear()
        self._handler = _Handler(self)
        self._container = Container(self._handler)
        self._thread = threading.Thread(
            target=self._container.run, daemon=True, name="servicebus-peer"
        )
        self._thread.start()
        if not self.ready.wait(10):
            raise RuntimeError("the Service Bus peer did not start")

    def stop(self) -> None:
        """Close every connection and stop listening."""
        if self._container is None or self._handler is None:
            return
        handler, container = self._handler, self._container

        def close() -> None:
            if handler.acceptor is not None:
                handler.acceptor.close()
            container.stop()

        container.schedule(0, _Call(close))  # type: ignore[arg-type]
        if self._thread is not None:
            self._thread.join(10)
        self._container = self._handler = self._thread = None

    def store(self, address: str, message: Message) -> None:
        """Keep one received message (called on the peer's thread)."""
        raw_properties: dict[Any, Any] = message.properties or {}
        properties = {
            _text(k) or "": (_text(v) if isinstance(v, bytes) else v)
            for k, v in raw_properties.items()
        }
        annotations: dict[Any, Any] = message.annotations or {}
        session = _text(message.group_id) or _text(annotations.get(symbol("x-opt-session-id")))
        received = Received(
            address=address,
            body=_body(message),
            message_id=_text(message.id),
            correlation_id=_text(message.correlation_id),
            subject=_text(message.subject),
            content_type=_text(message.content_type) or None,
            session_id=session,
            properties=properties,
        )
        with self._lock:
            self._received[address].append(received)

    def messages(self, address: str) -> list[Received]:
        """Everything received on ``address`` so far, in arrival order."""
        with self._lock:
            return list(self._received[address])

    def wait_for(self, address: str, count: int, timeout: float = 10.0) -> list[Received]:
        """Wait until ``count`` messages arrived on ``address``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.messages(address)
            if len(found) >= count:
                return found
            time.sleep(0.02)
        return self.messages(address)


class _Call:
    def __init__(self, function: Any) -> None:
        self.function = function

    def on_timer_task(self, _event: Any) -> None:
        self.function()


def main() -> None:
    """Run the peer in the foreground."""
    parser = argparse.ArgumentParser(description="a Service Bus peer for tests")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5673)
    args = parser.parse_args()
    peer = ServiceBusPeer(args.host, args.port)
    peer.start()
    print(f"listening; {peer.connection_string}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        peer.stop()


if __name__ == "__main__":
    main()
