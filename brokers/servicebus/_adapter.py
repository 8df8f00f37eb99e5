"""Azure Service Bus adapter (the azure-servicebus SDK, async).

Messages are sent in ``ServiceBusMessageBatch`` es, which respect the entity's size limit:
a batch is sent when the next message would not fit. Each message carries ``message_id`` =
the event id (the key of Service Bus duplicate detection), ``correlation_id``, ``subject`` =
the event type, ``content_type``, the envelope's headers as application properties, and
``session_id`` = the stream key when the entity is session-enabled. Batches of one
destination are sent one after the other, so a stream stays in order.

``publish_atomic`` sends each unit as one ``ServiceBusMessageBatch`` with one
``send_messages``: one AMQP transfer, which the entity takes or refuses whole. The units go one
after the other, in order (the SDK's sender takes one send at a time). Service Bus answers a
send with no position, so members are acknowledged without a receipt, as ``publish`` gives.
A unit is refused for good before anything is sent when it cannot be one batch:

- a member does not fit in the batch's size limit (the entity's, from the link: 256 KB on
  the Standard tier, 1 MB on Premium): the verdict names the member that did not fit;
- its members go to different entities (a batch goes to one queue or topic): the verdict
  names the first member bound elsewhere. Give such events one destination, or no atomicity;
- it holds more than ``max_unit`` (4,500) messages: the most Service Bus takes in one batch
  on the Basic and Standard tiers (Premium takes more). The service enforces that without
  saying so on the link (Azure/azure-service-bus#397) and refuses a larger batch with an
  error that reads as worth retrying, so the adapter refuses such a unit itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from azure.servicebus import ServiceBusMessage
from azure.servicebus.aio import ServiceBusClient, ServiceBusSender
from azure.servicebus.exceptions import (
    MessageSizeExceededError,
    MessagingEntityDisabledError,
    MessagingEntityNotFoundError,
    ServiceBusAuthenticationError,
    ServiceBusAuthorizationError,
    ServiceBusCommunicationError,
    ServiceBusConnectionError,
    ServiceBusError,
)

from brokers._describe import describe
from brokers._protocol import (
    OutgoingMessage,
    PublishResult,
    member_refused,
    unit_too_large,
    whole_unit,
)
from brokers.servicebus._settings import ServiceBusSettings
from envelopes import BrokerError, BrokerUnavailable

__all__ = ["ServiceBusBroker"]

log = logging.getLogger(__name__)

_UNAVAILABLE = (ServiceBusConnectionError, ServiceBusCommunicationError, ConnectionError, OSError)
_PERMANENT = (
    MessagingEntityNotFoundError,
    MessagingEntityDisabledError,
    MessageSizeExceededError,
    ServiceBusAuthenticationError,
    ServiceBusAuthorizationError,
)

MAX_UNIT = 4500
"""The most messages one atomic unit holds: one batch on any tier (see the module docstring)."""


class ServiceBusBroker:
    """Sends to Service Bus queues or topics; see ``brokers._protocol`` for the contract."""

    max_unit = MAX_UNIT

    def __init__(self, name: str, settings: ServiceBusSettings) -> None:
        self.name = name
        self.settings = settings
        self._client: ServiceBusClient | None = None
        self._senders: dict[str, ServiceBusSender] = {}
        # The SDK's senders are not safe to open or use from two tasks at once, and the
        # processor publishes the next batch while the current one is in flight: one at a time.
        self._sending = asyncio.Lock()
        self._detaching: set[asyncio.Task[Any]] = set()  # ping links closing in the background

    async def connect(self) -> None:
        """Create the client (connections open with the first sender)."""
        if self._client is None:
            # The SDK's own retries would hide an outage for a long while; the processor
            # retries each row on its own schedule instead.
            self._client = ServiceBusClient.from_connection_string(
                self.settings.connection_string.get_secret_value(),
                retry_total=0,
            )

    async def publish(self, batch: Sequence[OutgoingMessage]) -> list[PublishResult]:
        """Send the batch in size-limited SDK batches, per destination, in order."""
        async with self._sending:
            return await self._publish(batch)

    async def _publish(self, batch: Sequence[OutgoingMessage]) -> list[PublishResult]:
        await self.connect()
        results: list[PublishResult | None] = [None] * len(batch)
        by_destination: dict[str, list[int]] = {}
        for index, message in enumerate(batch):
            by_destination.setdefault(message.destination, []).append(index)
        for destination, indexes in by_destination.items():
            try:
                await self._send_to(destination, [(i, batch[i]) for i in indexes], results)
            except _Rejected as rejected:
                for index in indexes:
                    if results[index] is None:
                        results[index] = PublishResult.failed(
                            f"rejected by Service Bus: {describe(rejected.__cause__ or rejected)}",
                            retryable=False,
                        )
        return [r or PublishResult.failed("not sent", retryable=True) for r in results]

    async def _send_to(
        self,
        destination: str,
        messages: list[tuple[int, OutgoingMessage]],
        results: list[PublishResult | None],
    ) -> None:
        sender = await self._sender(destination)
        pending: list[int] = []
        sdk_batch = await self._new_batch(sender)
        for index, message in messages:
            sdk_message = self._message(message)
            try:
                sdk_batch.add_message(sdk_message)
            except MessageSizeExceededError:
                if pending:  # full: send it and start the next one with this message
                    await self._send_batch(sender, sdk_batch, pending, results)
                    pending = []
                    sdk_batch = await self._new_batch(sender)
                try:
                    sdk_batch.add_message(sdk_message)
                except MessageSizeExceededError:
                    results[index] = PublishResult.failed(
                        f"message too large for {destination!r} "
                        f"(at most {sdk_batch.max_size_in_bytes:,} bytes)",
                        retryable=False,
                    )
                    continue
            pending.append(index)
        if pending:
            await self._send_batch(sender, sdk_batch, pending, results)

    async def _send_batch(
        self,
        sender: ServiceBusSender,
        sdk_batch: Any,
        indexes: list[int],
        results: list[PublishResult | None],
    ) -> None:
        first = not any(r is not None and r.ok for r in results)
        outcome = await self._sent(sender, sdk_batch, first=first)
        for index in indexes:
            results[index] = outcome

    async def _sent(
        self, sender: ServiceBusSender, sdk_batch: Any, *, first: bool
    ) -> PublishResult:
        """Send one SDK batch; its one outcome. When the connection fails and nothing of this
        publish was acknowledged yet (``first``), raise ``BrokerUnavailable`` instead."""
        try:
            await asyncio.wait_for(sender.send_messages(sdk_batch), self.settings.publish_timeout)
        except _UNAVAILABLE as exc:
            if first:
                await self.close()
                raise BrokerUnavailable(
                    f"{self.name}: Service Bus unreachable: {describe(exc)}"
                ) from exc
            return PublishResult.cut_off(f"Service Bus unreachable: {describe(exc)}")
        except TimeoutError:
            return PublishResult.cut_off("no answer within publish_timeout")
        except _PERMANENT as exc:
            return PublishResult.failed(
                f"rejected by Service Bus: {describe(exc)}", retryable=False
            )
        except ServiceBusError as exc:
            return PublishResult.failed(f"Service Bus error: {describe(exc)}", retryable=True)
        return PublishResult.acked()

    async def publish_atomic(
        self, units: Sequence[Sequence[OutgoingMessage]]
    ) -> list[list[PublishResult]]:
        """Send each unit as one batch (all or nothing), the units in order; one verdict per
        unit (``brokers._protocol.AtomicBroker``)."""
        async with self._sending:
            await self.connect()
            verdicts: list[list[PublishResult]] = []
            for unit in units:
                first = not any(v and v[0].ok for v in verdicts)
                try:
                    verdicts.append(await self._send_unit(unit, first=first))
                except BrokerUnavailable as exc:
                    if first:
                        raise
                    cut = PublishResult.cut_off(str(exc))
                    verdicts.extend([cut] * len(rest) for rest in units[len(verdicts) :])
                    break
            return verdicts

    async def _send_unit(
        self, unit: Sequence[OutgoingMessage], *, first: bool
    ) -> list[PublishResult]:
        """One unit as one SDK batch, or its refusal when it cannot be one (module docstring)."""
        refused = unit_too_large(unit, self.max_unit, "Service Bus batch")
        if refused is not None or not unit:
            return refused or []
        ids = [m.wire.message_id for m in unit]
        destination = unit[0].destination
        for position, message in enumerate(unit):
            if message.destination != destination:
                error = (
                    f"goes to {message.destination!r} and member 1 to {destination!r}: "
                    "a Service Bus batch goes to one entity"
                )
                return member_refused(ids, position, error, retryable=False)
        sender = await self._sender(destination)
        try:
            sdk_batch = await self._new_batch(sender)
        except _Rejected as rejected:
            reason = f"rejected by Service Bus: {describe(rejected.__cause__ or rejected)}"
            return whole_unit(len(unit), PublishResult.failed(reason, retryable=False))
        for position, message in enumerate(unit):
            try:
                sdk_batch.add_message(self._message(message))
            except MessageSizeExceededError:
                error = (
                    f"does not fit in one batch for {destination!r} with the members before it "
                    f"(at most {sdk_batch.max_size_in_bytes:,} bytes)"
                )
                return member_refused(ids, position, error, retryable=False)
        return whole_unit(len(unit), await self._sent(sender, sdk_batch, first=first))

    async def _sender(self, destination: str) -> ServiceBusSender:
        sender = self._senders.get(destination)
        if sender is None:
            assert self._client is not None
            if self.settings.entity == "topic":
                sender = self._client.get_topic_sender(destination)
            else:
                sender = self._client.get_queue_sender(destination)
            self._senders[destination] = sender
        return sender

    async def _new_batch(self, sender: ServiceBusSender) -> Any:
        try:
            return await asyncio.wait_for(
                sender.create_message_batch(), self.settings.connect_timeout + 1
            )
        except (*_UNAVAILABLE, TimeoutError) as exc:
            await self.close()
            raise BrokerUnavailable(
                f"{self.name}: cannot reach Service Bus: {describe(exc)}"
            ) from exc
        except _PERMANENT as exc:
            raise _Rejected(exc) from exc

    def _message(self, message: OutgoingMessage) -> ServiceBusMessage:
        wire = message.wire
        properties: dict[str, Any] = self.settings.native_properties(wire)  # each its own type
        return ServiceBusMessage(
            wire.body,
            application_properties=_properties(self.settings.native_headers(wire)),
            **properties,
        )

    async def ping(self) -> None:
        """Attach a new sender link (a round trip on the connection) and detach it, beside
        any publish in flight: a cached link answers ``create_message_batch`` from memory,
        which proves nothing about a connection gone silent.

        An entity that does not exist still proves the namespace answered; refused
        credentials do not.
        """
        await self.connect()
        assert self._client is not None
        entity = _probe_entity(self.settings)
        if self.settings.entity == "topic":
            probe = self._client.get_topic_sender(entity)
        else:
            probe = self._client.get_queue_sender(entity)

        async def attach() -> None:
            try:
                await probe.create_message_batch()
            finally:
                # The attach was the round trip; the SDK's detach takes half a second more of
                # polling, which would only lengthen the ping and with it the silence limit.
                closing = asyncio.ensure_future(_close_quietly(probe))
                self._detaching.add(closing)
                closing.add_done_callback(self._detaching.discard)

        try:
            await asyncio.wait_for(attach(), self.settings.connect_timeout)
        except (MessagingEntityNotFoundError, MessagingEntityDisabledError):
            return
        except (ServiceBusAuthenticationError, ServiceBusAuthorizationError) as exc:
            await self.close()
            raise BrokerError(
                f"{self.name}: Service Bus refused the credentials: {describe(exc)}"
            ) from exc
        except (*_UNAVAILABLE, ServiceBusError, TimeoutError) as exc:
            raise BrokerUnavailable(
                f"{self.name}: Service Bus does not answer: {describe(exc)}"
            ) from exc

    async def close(self) -> None:
        """Close senders and the client."""
        senders, self._senders = list(self._senders.values()), {}
        client, self._client = self._client, None
        for closing in list(self._detaching):  # closing the client closes their links
            closing.cancel()
        for sender in senders:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(sender.close(), 5)
        if client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), 5)


async def _close_quietly(sender: ServiceBusSender) -> None:
    """Close a ping's sender in the background: whatever it raises, the ping is answered."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(sender.close(), 5)


def _properties(headers: dict[str, str]) -> dict[str | bytes, Any]:
    return dict(headers.items())


class _Rejected(Exception):
    """The entity cannot be used at all (missing, disabled, not authorised)."""


def _probe_entity(settings: ServiceBusSettings) -> str:
    """The entity a ping attaches to: the destination when it is a fixed name."""
    return settings.destination if "{" not in settings.destination else "outbox-router-ping"
