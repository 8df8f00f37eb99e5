"""One harness per broker: settings for a real peer, and a way to read what arrived there.

The contract tests are written once against this small interface and run for every
adapter, with the same assertions (as Watermill's pubsub conformance suite does).

A test that says a message arrives once reads with ``arrived_once``: everything that arrived,
read on for ``SETTLE`` seconds after the expected count, repeats counted by message id. With
``CONTRACT_DELIVER_TWICE=1`` in the environment, ``Harness.broker`` publishes every batch
twice (past JetStream's duplicate window), so each of those tests must fail: the proof that
they can see a repeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import aio_pika
import nats
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer
from azure.servicebus.aio import ServiceBusClient
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import NotFoundError
from pamqp import commands as amqp_commands

from brokers import Broker, BrokerSettings, OutgoingMessage, PublishResult, create_broker
from brokers.settings import (
    KafkaSettings,
    NatsSettings,
    RabbitSettings,
    RedisSettings,
    ServiceBusSettings,
)
from envelopes import WireMessage, message_id_of
from tests.conftest import NATS_URL
from tests.peers.servicebus import ServiceBusPeer
from tests.services import free_port

RABBIT_URL = "amqp://guest:guest@127.0.0.1:5672/"
REPLAY_GAP = 0.3  # seconds between two sends of one message in replay tests
REDIS_URL = "redis://127.0.0.1:6379/0"
# Seconds to read on after the expected count: a repeat sent right behind its original (as a
# relay that publishes a batch again at once does) lands within milliseconds on loopback.
SETTLE = 0.2
DELIVER_TWICE = "CONTRACT_DELIVER_TWICE"  # the switch: "1" publishes every batch twice


@dataclass(frozen=True)
class Arrived:
    """One message as the broker holds it."""

    body: bytes
    headers: dict[str, str]
    native_id: str | None  # the broker's own message id / dedup key
    key: str | None  # the partition key or session id, where the broker has one
    # The broker's own message properties besides the headers, where it has them
    # (AMQP 0-9-1 properties on RabbitMQ; message_id, subject, ... on Service Bus).
    properties: dict[str, str] = dataclasses.field(default_factory=dict)
    # Where the broker holds it, as the adapter's receipt should name it (JetStream stream
    # and sequence, Kafka topic, partition and offset, Redis stream and entry id); None on
    # brokers whose acknowledgement names no position.
    position: dict[str, Any] | None = None


class Harness:
    """What the contract suite needs from each broker."""

    kind = ""
    native_dedup = ""  # what carries the message id natively, for the report
    # Whether the broker's refusal at rejected_destination() is worth another try.
    refusal_retryable = False

    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex[:8]

    def settings(self, **overrides: Any) -> BrokerSettings:
        """Settings that reach the real peer."""
        raise NotImplementedError

    def unreachable(self) -> BrokerSettings:
        """Settings that point at a port nothing listens on."""
        raise NotImplementedError

    def replay_settings(self, **overrides: Any) -> BrokerSettings:
        """Settings under which the same message sent twice, ``REPLAY_GAP`` seconds apart,
        arrives twice (JetStream would otherwise drop the second as a duplicate)."""
        return self.settings(**overrides)

    def config(self, **overrides: Any) -> dict[str, Any]:
        """``settings(**overrides)`` as config.yaml holds them, secrets included."""
        return self.config_of(self.settings(**overrides))

    @staticmethod
    def config_of(settings: BrokerSettings) -> dict[str, Any]:
        """``settings`` as config.yaml holds them, secrets included."""
        data: dict[str, Any] = settings.model_dump(mode="json", exclude_none=True)
        for field in ("url", "connection_string"):  # model_dump masks secrets
            value = getattr(settings, field, None)
            if value is not None:
                data[field] = value.get_secret_value()
        return data

    def destination(self, label: str = "orders") -> str:
        """A destination no other test uses."""
        raise NotImplementedError

    def rejected_destination(self) -> str:
        """A destination the broker refuses outright."""
        raise NotImplementedError

    async def arrived(self, destination: str, count: int, timeout: float = 10) -> list[Arrived]:
        """Wait for ``count`` messages at ``destination``; return what is there, in order."""
        raise NotImplementedError

    async def everything(
        self, destination: str, count: int, timeout: float = 10, settle: float = SETTLE
    ) -> list[Arrived]:
        """Every message at ``destination``, repeats included, in order: wait for ``count``,
        then read on for ``settle`` seconds so that what came after them shows too."""
        await self.arrived(destination, count, timeout)
        return await self.arrived(destination, sys.maxsize, timeout=settle)

    async def arrived_once(
        self, destination: str, count: int, timeout: float = 10
    ) -> list[Arrived]:
        """``everything`` at ``destination``, failing the test if a message id came twice."""
        found = await self.everything(destination, count, timeout)
        again = repeats(found)
        assert not again, f"{len(again)} message ids arrived more than once: {again}"
        return found

    def broker(self, name: str, settings: BrokerSettings) -> Broker:
        """The adapter for ``settings``; with the switch on, one that publishes twice."""
        return contract_broker(name, settings)

    async def read_as_a_partner(self, destination: str, *, stream_key: str) -> list[Arrived]:
        """The one message at ``destination``, read with the broker's ordinary client (every
        harness's ``arrived`` does; Service Bus overrides this with the Azure SDK's receiver
        for the stream's session)."""
        return await self.arrived(destination, 1)

    async def prepare(self, destination: str) -> None:
        """Make the destination ready to keep what arrives (a bound queue, ...)."""

    async def cleanup(self) -> None:
        """Remove what the test created."""


class NatsHarness(Harness):
    kind = "nats"
    native_dedup = "Nats-Msg-Id header"

    def __init__(self, url: str = NATS_URL) -> None:
        """``url``: the shared server by default; an embedded one where a test needs a
        newer nats-server (atomic batches: 2.12 or later)."""
        super().__init__()
        self.url = url

    @property
    def stream(self) -> str:
        return f"CONTRACT_{self.tag}".upper()

    def settings(self, **overrides: Any) -> BrokerSettings:
        return NatsSettings.model_validate(
            {
                "type": "nats",
                "url": self.url,
                "destination": f"c{self.tag}.{{event_type}}",
                "stream": {
                    "name": self.stream,
                    "subjects": [f"c{self.tag}.>"],
                    "storage": "memory",
                },
                **overrides,
            }
        )

    def unreachable(self) -> BrokerSettings:
        return self.settings(url=f"nats://127.0.0.1:{free_port()}", connect_timeout=1)

    def replay_settings(self, **overrides: Any) -> BrokerSettings:
        stream = {
            "name": self.stream,
            "subjects": [f"c{self.tag}.>"],
            "storage": "memory",
            "duplicate_window_seconds": REPLAY_GAP / 2,
        }
        return self.settings(stream=stream, **overrides)

    def destination(self, label: str = "orders") -> str:
        return f"c{self.tag}.{label}"

    @property
    def small_stream(self) -> str:
        return f"CONTRACT_SMALL_{self.tag}".upper()

    def rejected_destination(self) -> str:
        return f"small{self.tag}.orders"  # captured by a stream that takes 64 bytes at most

    async def prepare(self, destination: str) -> None:
        if destination != self.rejected_destination():
            return  # the adapter creates its own stream
        client = await nats.connect(self.url)
        try:
            await client.jetstream().add_stream(
                StreamConfig(
                    name=self.small_stream,
                    subjects=[f"small{self.tag}.>"],
                    storage=StorageType.MEMORY,
                    max_msg_size=64,
                )
            )
        finally:
            await client.close()

    async def arrived(self, destination: str, count: int, timeout: float = 10) -> list[Arrived]:
        client = await nats.connect(self.url)
        try:
            js = client.jetstream()
            deadline = time.monotonic() + timeout
            total = 0
            while time.monotonic() < deadline:
                with contextlib.suppress(NotFoundError):
                    total = (await js.stream_info(self.stream)).state.messages
                if total >= count:
                    break
                await asyncio.sleep(0.05)
            found = [await js.get_msg(self.stream, seq=i) for i in range(1, total + 1)]
        finally:
            await client.close()
        return [
            Arrived(
                m.data or b"",
                dict(m.headers or {}),
                (m.headers or {}).get("Nats-Msg-Id"),
                None,
                position={"stream": self.stream, "seq": m.seq},
            )
            for m in found
            if m.subject == destination
        ]

    async def cleanup(self) -> None:
        client = await nats.connect(self.url)
        for stream in (self.stream, self.small_stream):
            with contextlib.suppress(NotFoundError):
                await client.jetstream().delete_stream(stream)
        await client.close()


class KafkaHarness(Harness):
    kind = "kafka"
    native_dedup = "record key = stream key; message-id header"

    def __init__(self, bootstrap: str) -> None:
        super().__init__()
        self.bootstrap = bootstrap

    def settings(self, **overrides: Any) -> BrokerSettings:
        return KafkaSettings.model_validate(
            {
                "type": "kafka",
                "bootstrap_servers": self.bootstrap,
                "idempotent": False,
                "destination": f"c{self.tag}.{{event_type}}",
                "max_request_size": 65536,
                **overrides,
            }
        )

    def unreachable(self) -> BrokerSettings:
        return self.settings(bootstrap_servers=f"127.0.0.1:{free_port()}", connect_timeout=1)

    def destination(self, label: str = "orders") -> str:
        return f"c{self.tag}.{label}"

    def rejected_destination(self) -> str:
        return ""  # Kafka refuses by size instead: see the suite

    async def arrived(self, destination: str, count: int, timeout: float = 10) -> list[Arrived]:
        return await self._consume(destination, count, timeout, settle=0)

    async def everything(
        self, destination: str, count: int, timeout: float = 10, settle: float = SETTLE
    ) -> list[Arrived]:
        # One consumer throughout: a fresh one may take longer than ``settle`` to fetch.
        return await self._consume(destination, count, timeout, settle)

    async def _consume(
        self, destination: str, count: int, timeout: float, settle: float
    ) -> list[Arrived]:
        """Records from the start of ``destination`` until ``count`` came (or ``timeout``
        passed), then on until none came for ``settle`` seconds."""
        consumer = AIOKafkaConsumer(
            destination,
            bootstrap_servers=self.bootstrap,
            auto_offset_reset="earliest",
            group_id=None,
            enable_auto_commit=False,
        )
        await consumer.start()
        found: list[Arrived] = []
        try:
            deadline = time.monotonic() + timeout
            while len(found) < count and time.monotonic() < deadline:
                batch = await consumer.getmany(timeout_ms=200)
                found.extend(self._record(r) for records in batch.values() for r in records)
            quiet_until = time.monotonic() + settle
            while time.monotonic() < quiet_until:
                before = len(found)
                batch = await consumer.getmany(timeout_ms=100)
                found.extend(self._record(r) for records in batch.values() for r in records)
                if len(found) > before:
                    quiet_until = time.monotonic() + settle
        finally:
            await consumer.stop()
        return found

    @staticmethod
    def _record(r: Any) -> Arrived:
        headers = {k: v.decode() for k, v in r.headers}
        key = r.key.decode() if r.key else None
        return Arrived(
            r.value,
            headers,
            headers.get("message-id"),
            key,
            _present(key=key, timestamp=str(r.timestamp)),
            position={"topic": r.topic, "partition": r.partition, "offset": r.offset},
        )


class RabbitHarness(Harness):
    kind = "rabbitmq"
    native_dedup = "AMQP message_id property"
    # Unroutable: the partner may bind a queue later (tests/integration/test_rabbitmq_unbound.py).
    refusal_retryable = True

    def __init__(self) -> None:
        super().__init__()
        self.exchange = f"contract-{self.tag}"
        self.queues: dict[str, str] = {}
        self.seen: dict[str, list[Arrived]] = {}  # reading a queue consumes it: keep what came

    def settings(self, **overrides: Any) -> BrokerSettings:
        return RabbitSettings.model_validate(
            {
                "type": "rabbitmq",
                "url": RABBIT_URL,
                "destination": f"c{self.tag}.{{event_type}}",
                "exchange": {"name": self.exchange, "type": "topic", "durable": False},
                **overrides,
            }
        )

    def unreachable(self) -> BrokerSettings:
        return self.settings(url=f"amqp://guest:guest@127.0.0.1:{free_port()}/", connect_timeout=1)

    def destination(self, label: str = "orders") -> str:
        return f"c{self.tag}.{label}"

    def rejected_destination(self) -> str:
        return f"c{self.tag}.nobody-listens"  # no queue bound: unroutable

    async def prepare(self, destination: str) -> None:
        if destination == self.rejected_destination():
            return  # nothing bound: the broker returns what is sent there
        connection = await aio_pika.connect(RABBIT_URL)
        async with connection:
            channel = await connection.channel()
            exchange = await channel.declare_exchange(self.exchange, "topic", durable=False)
            queue = await channel.declare_queue(
                f"contract-{self.tag}-{destination}", auto_delete=False
            )
            await queue.bind(exchange, routing_key=destination)
            self.queues[destination] = queue.name

    async def arrived(self, destination: str, count: int, timeout: float = 10) -> list[Arrived]:
        found = self.seen.setdefault(destination, [])
        connection = await aio_pika.connect(RABBIT_URL)
        async with connection:
            # The AMQP channel underneath: aio-pika's messages read an absent priority as 0.
            channel = await (await connection.channel()).get_underlay_channel()
            deadline = time.monotonic() + timeout
            while len(found) < count and time.monotonic() < deadline:
                delivered = await channel.basic_get(self.queues[destination], no_ack=True)
                if isinstance(delivered.delivery, amqp_commands.Basic.GetEmpty):
                    await asyncio.sleep(0.05)
                    continue
                raw = delivered.header.properties
                headers = {
                    k: (v.decode() if isinstance(v, bytes) else str(v))
                    for k, v in (raw.headers or {}).items()
                }
                found.append(
                    Arrived(delivered.body, headers, raw.message_id, None, _amqp_properties(raw))
                )
        return list(found)

    async def cleanup(self) -> None:
        connection = await aio_pika.connect(RABBIT_URL)
        async with connection:
            channel = await connection.channel()
            for queue in self.queues.values():
                with contextlib.suppress(Exception):
                    await channel.queue_delete(queue)
            with contextlib.suppress(Exception):
                await channel.exchange_delete(self.exchange)


class RedisHarness(Harness):
    kind = "redis"
    native_dedup = "none (message-id header)"

    def __init__(self, url: str = REDIS_URL, reader: str | None = None) -> None:
        """``url``: the router's (the shared server by default); ``reader``: the tests' own
        reads and preparations, by default the same."""
        super().__init__()
        self.url = url
        self.reader = reader or url

    def settings(self, **overrides: Any) -> BrokerSettings:
        return RedisSettings.model_validate(
            {
                "type": "redis",
                "url": self.url,
                "destination": f"c{self.tag}.{{event_type}}",
                **overrides,
            }
        )

    def unreachable(self) -> BrokerSettings:
        return self.settings(url=f"redis://127.0.0.1:{free_port()}/0", connect_timeout=1)

    def destination(self, label: str = "orders") -> str:
        return f"c{self.tag}.{label}"

    def rejected_destination(self) -> str:
        return f"c{self.tag}.a-string-key"  # holds a string: XADD gets WRONGTYPE

    async def prepare(self, destination: str) -> None:
        if destination == self.rejected_destination():
            client = aioredis.Redis.from_url(self.reader)
            await client.set(destination, "not a stream")
            await client.aclose()

    async def entries(self, destination: str, count: int, timeout: float = 10) -> list[Any]:
        """Wait for ``count`` entries at ``destination``; each one's fields, as XRANGE gives."""
        return [fields for _, fields in await self._xrange(destination, count, timeout)]

    async def _xrange(self, destination: str, count: int, timeout: float) -> list[Any]:
        client = aioredis.Redis.from_url(self.reader)
        try:
            deadline = time.monotonic() + timeout
            entries: Any = []
            while time.monotonic() < deadline:
                entries = await client.xrange(destination)
                if len(entries) >= count:
                    break
                await asyncio.sleep(0.05)
        finally:
            await client.aclose()
        return list(entries)

    async def arrived(self, destination: str, count: int, timeout: float = 10) -> list[Arrived]:
        # As any Redis client reads the plain format: a body field, every other one a header.
        found = []
        for entry_id, fields in await self._xrange(destination, count, timeout):
            headers = {k.decode(): v.decode() for k, v in fields.items() if k != b"body"}
            position = {"stream": destination, "id": entry_id.decode()}
            found.append(
                Arrived(
                    fields[b"body"], headers, headers.get("message-id"), None, position=position
                )
            )
        return found

    async def cleanup(self) -> None:
        client = aioredis.Redis.from_url(self.reader)
        keys = [k async for k in client.scan_iter(match=f"c{self.tag}.*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


class ServiceBusHarness(Harness):
    kind = "servicebus"
    native_dedup = "message_id (duplicate detection key)"

    def __init__(self, peer: ServiceBusPeer) -> None:
        super().__init__()
        self.peer = peer

    def settings(self, **overrides: Any) -> BrokerSettings:
        return ServiceBusSettings.model_validate(
            {
                "type": "servicebus",
                "connection_string": self.peer.connection_string,
                "destination": f"c{self.tag}-{{event_type}}",
                "sessions": True,
                **overrides,
            }
        )

    def unreachable(self) -> BrokerSettings:
        dead = self.peer.connection_string.replace(f":{self.peer.port};", f":{free_port()};")
        return self.settings(connection_string=dead, connect_timeout=2, publish_timeout=5)

    def destination(self, label: str = "orders") -> str:
        return f"c{self.tag}-{label}"

    def rejected_destination(self) -> str:
        destination = f"c{self.tag}-missing"
        self.peer.reject.add(destination)
        return destination

    async def read_as_a_partner(self, destination: str, *, stream_key: str) -> list[Arrived]:
        """Through the Azure SDK's receiver, for the stream's session (sessions are on)."""
        return await self.receive(destination, 1, session_id=stream_key)

    async def arrived(self, destination: str, count: int, timeout: float = 10) -> list[Arrived]:
        received = await asyncio.to_thread(self.peer.wait_for, destination, count, timeout)
        return [
            Arrived(
                r.body,
                {k: str(v) for k, v in r.properties.items()},
                r.message_id,
                r.session_id,
                {
                    **_present(
                        message_id=r.message_id,
                        correlation_id=r.correlation_id,
                        subject=r.subject,
                        content_type=r.content_type,
                        session_id=r.session_id,
                    ),
                    **r.others,
                },
            )
            for r in received
        ]

    async def receive(
        self, destination: str, count: int, session_id: str | None = None, timeout: float = 10
    ) -> list[Arrived]:
        """Read up to ``count`` messages from the queue ``destination`` with the Azure SDK's
        receiver (of ``session_id`` when given), completing each; fewer if ``timeout`` passes."""
        found: list[Arrived] = []
        client = ServiceBusClient.from_connection_string(self.peer.connection_string)
        async with (
            client,
            client.get_queue_receiver(destination, session_id=session_id) as receiver,
        ):
            deadline = time.monotonic() + timeout
            while len(found) < count and (left := deadline - time.monotonic()) > 0:
                for message in await receiver.receive_messages(
                    max_message_count=count - len(found), max_wait_time=left
                ):
                    await receiver.complete_message(message)
                    found.append(self._arrived_by_sdk(message))
        return found

    @staticmethod
    def _arrived_by_sdk(message: Any) -> Arrived:
        """A ``ServiceBusReceivedMessage`` as the contract suite compares it."""

        def text(value: Any) -> str:
            return value.decode() if isinstance(value, bytes) else str(value)

        return Arrived(
            b"".join(message.body),
            {text(k): text(v) for k, v in (message.application_properties or {}).items()},
            message.message_id,
            message.session_id,
            _present(
                message_id=message.message_id,
                correlation_id=message.correlation_id,
                subject=message.subject,
                content_type=message.content_type,
                session_id=message.session_id,
            ),
        )


def repeats(arrived: Sequence[Arrived]) -> dict[str, int]:
    """The message ids that arrived more than once, with how often: found as a consumer finds
    them (``message_id_of``), so whatever the envelope profile."""
    ids = Counter(message_id_of(a.body, a.headers, native_id=a.native_id) for a in arrived)
    return {str(mid): n for mid, n in ids.items() if n > 1}


def contract_broker(name: str, settings: BrokerSettings) -> Broker:
    """``create_broker``, or with ``CONTRACT_DELIVER_TWICE=1`` a ``DeliveredTwice``: also a
    ``broker_factory`` for a router whose "once" a test checks."""
    if os.environ.get(DELIVER_TWICE) == "1":
        return DeliveredTwice(name, settings)
    return create_broker(name, settings)


class _NatsSettingsAgain(NatsSettings):
    """NATS settings whose JetStream dedup key is not the message id: JetStream keeps what
    is published with them even when the same message went out a moment before."""

    def native_headers(self, wire: WireMessage) -> dict[str, str]:
        return {**super().native_headers(wire), "Nats-Msg-Id": f"{wire.message_id}.again"}


class DeliveredTwice:
    """A broker that publishes every batch twice, each message under the same message id
    both times: what a relay that repeats itself delivers. It exists to show that the contract's
    "once" tests see a repeat (``CONTRACT_DELIVER_TWICE=1``), and lives here, not in the
    router. The second publish goes through an adapter of its own; on NATS its Nats-Msg-Id
    differs, or JetStream would drop it as a duplicate for its whole window (2 min)."""

    def __init__(self, name: str, settings: BrokerSettings) -> None:
        self.name = name
        again = settings
        if isinstance(settings, NatsSettings):
            again = _NatsSettingsAgain.model_validate(settings.model_dump())
        self.first, self.again = create_broker(name, settings), create_broker(name, again)

    async def connect(self) -> None:
        """Connect both adapters."""
        await self.first.connect()
        await self.again.connect()

    async def publish(self, batch: Sequence[OutgoingMessage]) -> list[PublishResult]:
        """The batch, then again what the broker took of it; the first results."""
        results = await self.first.publish(batch)
        sent = [m for m, r in zip(batch, results, strict=True) if r.ok]
        if sent:
            await self.again.publish(sent)
        return results

    async def ping(self) -> None:
        """Ping both adapters."""
        await self.first.ping()
        await self.again.ping()

    async def close(self) -> None:
        """Close both adapters."""
        await self.first.close()
        await self.again.close()


# AMQP 0-9-1 properties besides the headers, by the names BrokerSettings.native_properties
# gives them (pamqp says message_type for type).
_AMQP_PROPERTIES = {
    "message_id": "message_id",
    "correlation_id": "correlation_id",
    "content_type": "content_type",
    "content_encoding": "content_encoding",
    "message_type": "type",
    "delivery_mode": "delivery_mode",
    "timestamp": "timestamp",
    "priority": "priority",
    "expiration": "expiration",
    "reply_to": "reply_to",
    "user_id": "user_id",
    "app_id": "app_id",
    "cluster_id": "cluster_id",
}


def _amqp_properties(raw: Any) -> dict[str, str]:
    """Every AMQP property the message carries, as text (a timestamp in epoch seconds)."""
    found = {}
    for attribute, name in _AMQP_PROPERTIES.items():
        value = getattr(raw, attribute, None)
        if value is None or value == "":
            continue
        if hasattr(value, "timestamp"):
            value = int(value.timestamp())
        found[name] = str(value)
    return found


def _present(**properties: str | None) -> dict[str, str]:
    """The properties that are set."""
    return {k: v for k, v in properties.items() if v is not None}


@contextlib.asynccontextmanager
async def harness_for(kind: str, request: Any) -> AsyncIterator[Harness]:
    """The harness of ``kind``, its peer started by the session fixtures."""
    harness: Harness
    if kind == "nats":
        harness = NatsHarness()
    elif kind == "kafka":
        harness = KafkaHarness(request.getfixturevalue("kafka_peer"))
    elif kind == "rabbitmq":
        harness = RabbitHarness()
    elif kind == "redis":
        harness = RedisHarness()
    else:
        harness = ServiceBusHarness(request.getfixturevalue("servicebus_peer"))
    try:
        yield harness
    finally:
        await harness.cleanup()
