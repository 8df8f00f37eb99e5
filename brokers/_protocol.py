"""The broker adapter protocol and its delivery contract.

An adapter turns rendered messages into broker writes. The processor relies on this contract:

- ``connect()`` opens what the adapter needs (connection, stream/topic checks). It raises
  ``BrokerUnavailable`` if the broker cannot be reached, and may be called again after
  ``close()`` or after a failure to reconnect.
- ``publish(batch)`` connects first if there is no connection (raising ``BrokerUnavailable``
  when that fails), then returns one ``PublishResult`` per message, in the batch's order, and
  returns only after the broker acknowledged each successful message *durably* (JetStream
  PubAck, Kafka acks=all, AMQP publisher confirm, ...). Messages may be in flight together;
  messages sharing a stream key must be written in batch order. A failure of one message never
  fails the others. If the broker cannot be reached at all, ``publish`` raises
  ``BrokerUnavailable`` instead, and nothing in the batch counts as sent.
- A message the broker did not judge (never sent because the connection broke, or no ack
  within the timeout) is ``PublishResult.cut_off``: a fault of the path, not of the message.
  Only the broker's own refusal is ``PublishResult.failed``.
- Every message carries ``wire.message_id`` as the broker's native dedup id where one exists.
- An acknowledged result carries the broker's *receipt* where the broker gives one: a small
  JSON object naming where the message landed (JetStream stream and sequence, Kafka partition
  and offset, Redis entry id, RabbitMQ confirm time). It is stored on the row and shown by
  ``router trace``, so an operator can prove which partner got which event.
- ``ping()`` checks the broker answers (raises ``BrokerUnavailable``); ``close()`` is idempotent.

An adapter whose broker has an atomic write (a JetStream batch, a Service Bus batch, a Redis
``MULTI``/``EXEC``) is also an ``AtomicBroker``: ``publish_atomic(units)`` writes each unit
(the rows of one application transaction for the target) as one such write, all of its
messages stored or none, with one verdict per unit (``unit_verdict``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from envelopes import WireMessage

__all__ = [
    "AtomicBroker",
    "Broker",
    "OutgoingMessage",
    "PublishResult",
    "member_refused",
    "unit_too_large",
    "unit_verdict",
    "whole_unit",
]


@dataclass(slots=True)  # not frozen, like WireMessage: one is made per message
class OutgoingMessage:
    """A rendered message and the destination (subject, topic, queue...) it goes to."""

    destination: str
    wire: WireMessage


@dataclass(frozen=True, slots=True)
class PublishResult:
    """The outcome of one message: acknowledged, or failed with a reason."""

    ok: bool
    error: str | None = None
    retryable: bool = True
    receipt: str | None = None
    """The broker's receipt as a JSON object's text, when it gave one."""
    unreachable: bool = False
    """The broker was not reached, or gave no answer in time: a fault of this host's path to
    it, not a verdict on the message (see ``cut_off``)."""

    @classmethod
    def acked(cls, receipt: str | None = None) -> PublishResult:
        """The broker durably acknowledged the message (``receipt``: where it landed)."""
        return _ACKED if receipt is None else cls(ok=True, receipt=receipt)

    @classmethod
    def failed(cls, error: str, *, retryable: bool) -> PublishResult:
        """The broker did not take the message; ``retryable`` says if trying again can help."""
        return cls(ok=False, error=error, retryable=retryable)

    @classmethod
    def cut_off(cls, error: str) -> PublishResult:
        """No verdict on the message: it was not sent (the connection is gone) or its ack never
        came (the path went silent). The processor gives it back untried, for another host."""
        return cls(ok=False, error=error, retryable=True, unreachable=True)


_ACKED = PublishResult(ok=True)


@runtime_checkable
class Broker(Protocol):
    """What the processor needs from a broker (see the module docstring for the contract)."""

    name: str

    async def connect(self) -> None:
        """Connect, and create or check the destinations the settings ask for."""

    async def publish(self, batch: Sequence[OutgoingMessage]) -> list[PublishResult]:
        """Publish a batch; one result per message, after durable acknowledgement."""

    async def ping(self) -> None:
        """Raise ``BrokerUnavailable`` unless the broker answers."""

    async def close(self) -> None:
        """Release connections; safe to call more than once."""


@runtime_checkable
class AtomicBroker(Broker, Protocol):
    """A broker with an atomic write of several messages (see the module docstring)."""

    max_unit: int
    """The most messages one atomic write may hold (JetStream: 1,000)."""

    async def publish_atomic(
        self, units: Sequence[Sequence[OutgoingMessage]]
    ) -> list[list[PublishResult]]:
        """Publish each unit as one atomic write; per unit, one result per message, in order.

        Within a unit every result has the same verdict: all acknowledged (each with its own
        receipt where the broker gives one), all failed with one error that names the member
        the broker refused, or all cut off. No two units of one call share a stream key (the
        caller sends waves, as for ``publish``); units of a call may be in flight together
        and are written in order. Raises ``BrokerUnavailable`` as ``publish`` does.
        """


def unit_verdict(members: Sequence[PublishResult], ids: Sequence[str]) -> list[PublishResult]:
    """One verdict for a unit from its members' own outcomes (``ids``: their message ids).

    Acknowledged when every member is; otherwise the first refusal (not a cut-off) decides,
    named by its member, and every member takes it: the broker stored none of them. With no
    refusal, a member cut off cuts the whole unit off."""
    if all(r.ok for r in members):
        return list(members)
    for index, result in enumerate(members):
        if not result.ok and not result.unreachable:
            error = (
                f"atomic unit of {len(members)} refused: member {index + 1} "
                f"({ids[index]}): {result.error}"
            )
            verdict = PublishResult.failed(error, retryable=result.retryable)
            return [verdict] * len(members)
    cut = next(r for r in members if not r.ok)
    return [cut] * len(members)


def member_refused(
    ids: Sequence[str], position: int, error: str, *, retryable: bool
) -> list[PublishResult]:
    """The verdict on a unit whose member at ``position`` cannot go as it is, found before
    anything of the unit was sent: every member fails, naming that one (``unit_verdict``)."""
    members = [PublishResult.acked()] * len(ids)
    members[position] = PublishResult.failed(error, retryable=retryable)
    return unit_verdict(members, ids)


def whole_unit(size: int, outcome: PublishResult) -> list[PublishResult]:
    """Every member of a unit of ``size`` with the one ``outcome`` the broker gave the unit as
    a whole: acknowledged, cut off, or refused without singling out a member (which the
    error then says)."""
    if outcome.ok or outcome.unreachable:
        return [outcome] * size
    refusal = PublishResult.failed(
        f"atomic unit of {size} refused whole: {outcome.error}", retryable=outcome.retryable
    )
    return [refusal] * size


def unit_too_large(
    unit: Sequence[OutgoingMessage], limit: int, write: str
) -> list[PublishResult] | None:
    """Every member refused for good, unsent, when ``unit`` holds more than ``limit``
    messages (``write``: what the broker calls its atomic write); None when it fits."""
    if len(unit) <= limit:
        return None
    refusal = PublishResult.failed(
        f"an atomic unit of {len(unit):,} messages; a {write} holds {limit:,}", retryable=False
    )
    return [refusal] * len(unit)
