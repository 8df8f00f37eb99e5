"""A small Azure Service Bus peer: just enough AMQP 1.0 for the unchanged azure-servicebus SDK
to send to it and to receive from it, so the Service Bus adapter is tested over a real AMQP
connection and a partner reads what arrived with the SDK's own receiver.

    python -m tests.peers.servicebus --port 5673

Connection string for it::

    Endpoint=sb://localhost:5673;SharedAccessKeyName=x;SharedAccessKey=y;UseDevelopmentEmulator=true;

What it does (and all it does):

- accepts plain AMQP with SASL ANONYMOUS (``UseDevelopmentEmulator=true`` turns TLS off);
- answers every token put on the ``$cbs`` node with status 202, ``correlation_id`` set to the
  request's ``message_id``, as Service Bus does for a valid SAS token;
- accepts transfers on any address and keeps the messages per address, unpacking the SDK's
  batch format (one transfer wrapping several encoded messages): ``messages(address)`` lists
  all that arrived, and each one also waits in the address's queue for a receiver;
- rejects transfers to addresses in ``reject`` with ``amqp:not-found`` and an info map (the
  SDK hangs until its timeout on a rejection without one);
- emulates an entity's duplicate detection when ``duplicate_detection`` names it (entity ->
  its ``duplicateDetectionHistoryTimeWindow`` in seconds): a message whose ``message_id`` was
  stored on that entity within the window is accepted and dropped, each message of a batch on
  its own, as Azure does;
- serves receivers (``get_queue_receiver``): sends the waiting messages of the queue in
  arrival order, each as the SDK sent it, as far as the link's credit goes (and honours a
  drain). With ``RECEIVE_AND_DELETE`` a message is sent settled and leaves the queue; with
  ``PEEK_LOCK`` it is locked to that delivery until the receiver's disposition: accepted
  (``complete_message``) removes it, modified (``abandon_message``) or released makes it
  deliverable again, and the outcome is echoed back settled, which the SDK waits for.
  Messages still locked when their link closes become deliverable again;
- serves session receivers (``session_id=``, which the SDK asks for with a
  ``com.microsoft:session-filter`` on the link source) with that session's messages only (a
  message's session is its ``group_id``), and echoes the filter and a session lock time on
  the attach; ``NEXT_AVAILABLE_SESSION`` gets the session of the oldest waiting message, or
  ``com.microsoft:timeout`` when no message has one;
- answers every request on a ``$management`` node (peek, renew lock, settle by lock token,
  session state, ...) with status 501 and a description: receiving and completing over the
  receiver link need none of them.

It proves the adapter drives the real SDK over a real AMQP 1.0 connection; it does not
model Azure's other server-side features: no scheduling, no deferral or dead-lettering
(refused with ``amqp:not-implemented``), no lock expiry or renewal (a session lock is
announced for an hour; every lock holds until settled or its link closes), no delivery
counts or sequence numbers, no exclusive session locks, no topic subscriptions, and no
session-enabled entities (a plain receiver gets every message, whatever its session).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from proton import Condition, Data, Delivery, Link, Message, symbol
from proton.handlers import MessagingHandler
from proton.reactor import Container

from tests.peers import end

CONNECTION_STRING = (
    "Endpoint=sb://localhost:{port};SharedAccessKeyName=x;SharedAccessKey=y;"
    "UseDevelopmentEmulator=true;"
)
_BATCH_FORMAT = 0x80013700
_SESSION_FILTER = symbol("com.microsoft:session-filter")
_SESSION_LOCKED_UNTIL = symbol("com.microsoft:locked-until-utc")
_TICKS_AT_UNIX_EPOCH = 621_355_968_000_000_000  # .NET ticks (100 ns) from 0001-01-01 to 1970
_LOCK_SECONDS = 3600
_NOT_IMPLEMENTED = "amqp:not-implemented"
_OUTCOMES = (Delivery.ACCEPTED, Delivery.REJECTED, Delivery.RELEASED, Delivery.MODIFIED)


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
    # Every other AMQP header field, property and annotation the sender set, as text.
    others: dict[str, str] = field(default_factory=dict)


# AMQP 1.0 fields besides those above, with the value proton gives when one is absent.
_ABSENT = {
    "durable": False,
    "priority": 4,
    "ttl": 0,
    "first_acquirer": False,
    "delivery_count": 0,
    "user_id": b"",
    "address": None,
    "reply_to": None,
    "content_encoding": None,
    "expiry_time": 0,
    "creation_time": 0,
    "group_sequence": 0,
    "reply_to_group_id": None,
}


def _others(message: Message) -> dict[str, str]:
    """The fields of ``_ABSENT`` that are set, and every message annotation."""
    found = {}
    for name, absent in _ABSENT.items():
        value = getattr(message, name, absent)
        if value != absent and value is not None and str(value) != "None":
            found[name] = str(value)
    for key, value in (message.annotations or {}).items():
        found[f"annotation {_text(key)}"] = str(value)
    return found


@dataclass
class _Waiting:
    """A message in a queue: the bytes the SDK sent, and whether a receiver holds its lock."""

    encoded: bytes
    session_id: str | None
    locked: bool = False  # out on a delivery until the receiver settles it


class _History:
    """When each message id was stored, per entity with duplicate detection on (touched on the
    peer's thread only)."""

    def __init__(self, windows: dict[str, float]) -> None:
        self.windows = windows
        self._stored: dict[str, dict[str, float]] = defaultdict(dict)

    def repeated(self, address: str, message_id: str | None) -> bool:
        """Whether ``message_id`` was stored on ``address`` within its window; when not, it is
        remembered as stored now. Azure gives an id-less message one, so it never repeats."""
        window = self.windows.get(address)
        if window is None or message_id is None:
            return False
        now = time.monotonic()
        stored = self._stored[address].get(message_id)
        if stored is not None and now - stored < window:
            return True
        self._stored[address][message_id] = now
        return False


class _Queues:
    """The messages waiting per address, in arrival order (touched on the peer's thread only)."""

    def __init__(self) -> None:
        self._waiting: dict[str, list[_Waiting]] = defaultdict(list)

    def put(self, address: str, encoded: bytes, session_id: str | None) -> None:
        """Keep a message until a receiver takes it."""
        self._waiting[address].append(_Waiting(encoded, session_id))

    def next(self, address: str, session_id: str | None) -> _Waiting | None:
        """The oldest unlocked message of ``session_id`` (of any session when None)."""
        for waiting in self._waiting[address]:
            if not waiting.locked and session_id in (None, waiting.session_id):
                return waiting
        return None

    def oldest_session(self, address: str) -> str | None:
        """The session of the oldest unlocked message that has one."""
        for waiting in self._waiting[address]:
            if not waiting.locked and waiting.session_id is not None:
                return waiting.session_id
        return None

    def remove(self, address: str, waiting: _Waiting) -> None:
        """Forget a message a receiver took for good."""
        self._waiting[address].remove(waiting)


@dataclass
class _Outlet:
    """A receiver the SDK attached to a queue, and the messages locked to its deliveries."""

    link: Link
    address: str
    session_id: str | None  # None: every message of the queue
    presettled: bool  # RECEIVE_AND_DELETE: what is sent is settled and gone
    locked: dict[Delivery, _Waiting] = field(default_factory=dict)


class _Handler(MessagingHandler):
    def __init__(self, peer: ServiceBusPeer) -> None:
        super().__init__(prefetch=100, auto_accept=False, auto_settle=True)
        self.peer = peer
        self.acceptor: Any = None
        self.queues = _Queues()
        self.outlets: dict[Link, _Outlet] = {}

    def on_start(self, event: Any) -> None:
        self.acceptor = event.container.listen(f"{self.peer.host}:{self.peer.port}")
        self.peer.ready.set()

    def on_connection_opening(self, event: Any) -> None:
        event.connection.container = "servicebus-peer"

    def on_link_opening(self, event: Any) -> None:
        # MessagingHandler opens the link once this returns (opening it twice would send the
        # link properties twice).
        link = event.link
        if link.is_sender:
            link.source.address = link.remote_source.address
            address = _entity(link.remote_source.address)
            if not _is_node(address):
                self._open_outlet(link, address)
        else:
            link.target.address = link.remote_target.address

    def on_link_opened(self, event: Any) -> None:
        if event.link.condition is not None:  # refused by _open_outlet
            event.link.close()

    def _open_outlet(self, link: Link, address: str) -> None:
        link.snd_settle_mode = link.remote_snd_settle_mode
        link.rcv_settle_mode = link.remote_rcv_settle_mode
        filters = _filters(link.remote_source)
        session_id = None
        if _SESSION_FILTER in filters:
            session_id = _text(filters[_SESSION_FILTER]) or self.queues.oldest_session(address)
            if session_id is None:
                link.condition = Condition(
                    "com.microsoft:timeout", f"no session of '{address}' has a message waiting"
                )
                return
            # The SDK reads the session it got from the filter echoed on the attach.
            link.source.filter.put_dict({_SESSION_FILTER: session_id})
            link.properties = {_SESSION_LOCKED_UNTIL: _ticks(time.time() + _LOCK_SECONDS)}
        presettled = link.remote_snd_settle_mode == Link.SND_SETTLED
        self.outlets[link] = _Outlet(link, address, session_id, presettled)

    def on_link_flow(self, event: Any) -> None:
        outlet = self.outlets.get(event.link)
        if outlet is not None:
            self._pump(outlet)

    def _pump(self, outlet: _Outlet) -> None:
        """Send waiting messages while the receiver gives credit."""
        link = outlet.link
        while link.credit > 0:
            waiting = self.queues.next(outlet.address, outlet.session_id)
            if waiting is None:
                break
            tag = uuid.uuid4().bytes  # the SDK reads the message's lock token off the tag
            delivery = link.delivery(tag)  # type: ignore[arg-type]
            link.send(waiting.encoded)
            link.advance()
            if outlet.presettled:
                delivery.settle()
                self.queues.remove(outlet.address, waiting)
            else:
                waiting.locked = True
                outlet.locked[delivery] = waiting
        if link.drain_mode:
            link.drained()

    def _pump_address(self, address: str) -> None:
        for outlet in list(self.outlets.values()):
            if outlet.address == address:
                self._pump(outlet)

    def on_link_closing(self, event: Any) -> None:
        self._close_outlet(event.link)
        event.link.close()

    def on_transport_closed(self, event: Any) -> None:
        for link in [link for link in self.outlets if link.connection == event.connection]:
            self._close_outlet(link)

    def _close_outlet(self, link: Link) -> None:
        outlet = self.outlets.pop(link, None)
        if outlet is None:
            return
        for waiting in outlet.locked.values():
            waiting.locked = False
        if outlet.locked:
            self._pump_address(outlet.address)

    def on_delivery(self, event: Any) -> None:
        link: Link = event.link
        delivery: Delivery = event.delivery
        if link.is_sender:
            outlet = self.outlets.get(link)
            if outlet is not None and delivery.updated:
                self._disposed(outlet, delivery)
            return
        # MessagingHandler's own child handlers see every delivery too: they settle what we
        # send ($cbs answers); we take the raw bytes of what we receive, to unpack batches.
        if not delivery.readable or delivery.partial:
            return
        raw = link.recv(delivery.pending)
        link.advance()
        self._received(link, delivery, raw)

    def _disposed(self, outlet: _Outlet, delivery: Delivery) -> None:
        """Apply a receiver's outcome for a locked message, and echo it settled."""
        state = delivery.remote_state
        if state not in _OUTCOMES:
            return
        waiting = outlet.locked.pop(delivery, None)
        if waiting is None:
            return
        undeliverable = state == Delivery.MODIFIED and delivery.remote.undeliverable
        if state == Delivery.ACCEPTED:
            self.queues.remove(outlet.address, waiting)
            delivery.update(state)
        elif state in (Delivery.RELEASED, Delivery.MODIFIED) and not undeliverable:
            waiting.locked = False
            delivery.local.failed = delivery.remote.failed
            delivery.update(state)
        else:  # rejected (dead-letter) or modified undeliverable-here (defer)
            waiting.locked = False
            delivery.local.condition = Condition(
                _NOT_IMPLEMENTED, "the Service Bus peer neither defers nor dead-letters messages"
            )
            delivery.update(Delivery.REJECTED)
        delivery.settle()
        self._pump_address(outlet.address)

    def _received(self, link: Link, delivery: Delivery, raw: bytes) -> None:
        address = _entity(link.remote_target.address or link.target.address)
        message = Message()
        message.decode(raw)
        if address == "$cbs":
            self._reply(link, message, {"status-code": 202, "status-description": "Accepted"})
            self.accept(delivery)
            return
        if _is_node(address):  # a $management request
            request: dict[Any, Any] = message.properties or {}
            operation = _text(request.get("operation"))
            self._reply(
                link,
                message,
                {
                    "statusCode": 501,
                    "statusDescription": f"The Service Bus peer does not implement {operation}.",
                    "errorCondition": _NOT_IMPLEMENTED,
                },
            )
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
        for encoded, inner in _unpack(raw, message):
            if self.peer.history.repeated(address, _text(inner.id)):
                continue  # accepted with the rest of the transfer, and dropped
            self.peer.store(address, inner)
            self.queues.put(address, encoded, _session(inner))
        self.accept(delivery)
        self._pump_address(address)

    def _reply(self, link: Link, request: Message, status: dict[str, Any]) -> None:
        # The SDK sends no reply_to: the answer goes back on its receiving link for the node.
        reply_to = request.reply_to or link.remote_target.address
        reply = Message(address=reply_to, correlation_id=request.id, properties=status)
        other = link.connection.link_head(0)
        while other is not None:
            if other.is_sender and other.source.address == reply_to:
                other.send(reply)
                return
            other = other.next(0)


def _is_node(address: str) -> bool:
    """Whether ``address`` is a service node ($cbs, an entity's $management), not a queue."""
    return address == "$cbs" or address.rsplit("/", 1)[-1] == "$management"


def _filters(terminus: Any) -> dict[Any, Any]:
    """The filter set on a link's source, as a dict."""
    data = terminus.filter
    data.rewind()
    if data.next() is None:
        return {}
    found = data.get_object()
    return dict(found) if isinstance(found, dict) else {}


def _ticks(seconds: float) -> int:
    """A Unix time as .NET ticks, as Service Bus gives a session's locked-until time."""
    return _TICKS_AT_UNIX_EPOCH + int(seconds * 10_000_000)


def _session(message: Message) -> str | None:
    annotations: dict[Any, Any] = message.annotations or {}
    return _text(message.group_id) or _text(annotations.get(symbol("x-opt-session-id")))


def _entity(address: str | None) -> str:
    """The SDK addresses entities as amqps://host:port/<entity>; keep the entity path."""
    if not address:
        return ""
    if "://" in address:
        return urlsplit(address).path.lstrip("/")
    return address


def _unpack(raw: bytes, message: Message) -> list[tuple[bytes, Message]]:
    """The SDK sends a list or batch as one transfer whose data sections each hold one whole
    encoded message; a plain message is returned as it is. Each comes with its encoding."""
    inner = [bytes(value) for descriptor, value in _sections(raw) if descriptor == 0x75]
    if len(inner) < 1 or not all(_is_message(part) for part in inner):
        return [(raw, message)]
    messages = []
    for encoded in inner:
        decoded = Message()
        decoded.decode(encoded)
        messages.append((encoded, decoded))
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
    """The peer, run on a background thread; ``messages(address)`` shows what arrived.
    ``duplicate_detection``: the entities with duplicate detection on, each with its window in
    seconds."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 5673,
        duplicate_detection: dict[str, float] | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.reject: set[str] = set()
        # Beside what was received, not in the handler: like Azure's, it outlives a restart.
        self.history = _History(dict(duplicate_detection or {}))
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
        received = Received(
            address=address,
            body=_body(message),
            message_id=_text(message.id),
            correlation_id=_text(message.correlation_id),
            subject=_text(message.subject),
            content_type=_text(message.content_type) or None,
            session_id=_session(message),
            properties=properties,
            others=_others(message),
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


class ServiceBusPeerProcess(ServiceBusPeer):
    """The peer in a process of its own (``main()``), for a test whose own event loop is busy
    enough (a load generator and a TCP proxy, say) to slow a peer that shares its interpreter,
    and with it the answer times the router's silence limit follows. What arrived is read
    back with the SDK's receiver (and kept: each call returns all that was read so far).
    ``reject`` is not passed on; ``duplicate_detection`` is."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 5673,
        duplicate_detection: dict[str, float] | None = None,
    ) -> None:
        super().__init__(host, port, duplicate_detection)
        self.process: subprocess.Popen[str] | None = None
        self._read: dict[str, list[Received]] = defaultdict(list)

    def start(self) -> None:
        """Start the process; return once it listens."""
        detection = [
            f"--duplicate-detection={entity}={seconds}"
            for entity, seconds in self.history.windows.items()
        ]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.peers.servicebus", "--port", str(self.port), *detection],
            cwd=Path(__file__).resolve().parents[2],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()  # "listening; ..." once ready, "" if it died
        if not line.startswith("listening"):
            self.stop()
            raise RuntimeError(f"the Service Bus peer process did not start: {line!r}")

    def stop(self) -> None:
        """Stop the process."""
        process, self.process = self.process, None
        end(process)

    def messages(self, address: str) -> list[Received]:
        """What was read from ``address`` so far, and whatever waits there now."""
        return self.wait_for(address, sys.maxsize, timeout=1.0)

    def wait_for(self, address: str, count: int, timeout: float = 10.0) -> list[Received]:
        """Read (and complete) from the queue ``address`` until ``count`` messages were read
        in all, or ``timeout`` passes."""
        from azure.servicebus import ServiceBusClient

        got = self._read[address]
        deadline = time.monotonic() + timeout
        with (
            ServiceBusClient.from_connection_string(self.connection_string) as client,
            client.get_queue_receiver(address) as receiver,
        ):
            while len(got) < count and (left := deadline - time.monotonic()) > 0:
                wanted = min(count - len(got), 500)
                for message in receiver.receive_messages(wanted, max_wait_time=left):
                    receiver.complete_message(message)
                    got.append(_received_by_sdk(address, message))
        return list(got)


def _received_by_sdk(address: str, message: Any) -> Received:
    """A message the SDK's receiver read, as ``messages()`` lists it."""

    def text(value: Any) -> str | None:
        return (
            value.decode() if isinstance(value, bytes) else (None if value is None else str(value))
        )

    return Received(
        address=address,
        body=b"".join(message.body),
        message_id=text(message.message_id),
        correlation_id=text(message.correlation_id),
        subject=text(message.subject),
        content_type=text(message.content_type),
        session_id=text(message.session_id),
        properties={
            text(k) or "": text(v) for k, v in (message.application_properties or {}).items()
        },
        others={},
    )


class _Call:
    def __init__(self, function: Any) -> None:
        self.function = function

    def on_timer_task(self, _event: Any) -> None:
        self.function()


def _window(text: str) -> tuple[str, float]:
    """``ENTITY=SECONDS`` as (entity, seconds)."""
    entity, _, seconds = text.rpartition("=")
    if not entity:
        raise argparse.ArgumentTypeError(f"expected ENTITY=SECONDS, got {text!r}")
    return entity, float(seconds)


def main() -> None:
    """Run the peer in the foreground."""
    parser = argparse.ArgumentParser(description="a Service Bus peer for tests")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5673)
    parser.add_argument(
        "--duplicate-detection",
        action="append",
        default=[],
        type=_window,
        metavar="ENTITY=SECONDS",
        help="turn duplicate detection on for ENTITY, with that window (repeatable)",
    )
    args = parser.parse_args()
    peer = ServiceBusPeer(args.host, args.port, dict(args.duplicate_detection))
    peer.start()
    print(f"listening; {peer.connection_string}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        peer.stop()


if __name__ == "__main__":
    main()
