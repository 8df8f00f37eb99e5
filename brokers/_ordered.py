"""Publishing a batch message by message, with acks in flight but each stream in order.

For brokers whose client confirms one message at a time (RabbitMQ, Redis, Kafka through
FastStream): messages of one stream key are sent one after the other, in batch order, and a
stream stops at its first failure; other streams and keyless messages go concurrently, at
most ``concurrency`` at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from brokers._protocol import OutgoingMessage, PublishResult
from envelopes import BrokerUnavailable

__all__ = ["publish_in_order"]

Send = Callable[[OutgoingMessage], Awaitable[None]]
Classify = Callable[[Exception], PublishResult]

_NOT_SENT = "not sent: an earlier message of its stream failed"


async def publish_in_order(
    batch: Sequence[OutgoingMessage], send: Send, classify: Classify, *, concurrency: int
) -> list[PublishResult]:
    """Send every message; one result per message, in batch order.

    ``send`` returns once the broker confirmed the message, or raises. ``classify`` turns an
    exception into a failed result. If ``send`` raises ``BrokerUnavailable`` and nothing was
    confirmed, that is raised again: the broker could not be used at all.
    """
    results: list[PublishResult | None] = [None] * len(batch)
    chains: dict[str | None, list[int]] = {}
    for index, message in enumerate(batch):
        key = message.wire.stream_key
        chains.setdefault(key, []).append(index)
    gate = asyncio.Semaphore(concurrency)
    unavailable: list[BrokerUnavailable] = []

    async def one(index: int) -> bool:
        async with gate:
            try:
                await send(batch[index])
            except BrokerUnavailable as exc:
                unavailable.append(exc)
                results[index] = PublishResult.failed(str(exc), retryable=True)
                return False
            except Exception as exc:  # the adapter's classify decides what it means
                results[index] = classify(exc)
                return False
            results[index] = PublishResult.acked()
            return True

    async def chain(indexes: list[int]) -> None:
        for position, index in enumerate(indexes):
            if not await one(index):
                for later in indexes[position + 1 :]:
                    results[later] = PublishResult.failed(_NOT_SENT, retryable=True)
                return

    keyless = chains.pop(None, [])
    await asyncio.gather(*(one(i) for i in keyless), *(chain(c) for c in chains.values()))
    final = [
        r if r is not None else PublishResult.failed(_NOT_SENT, retryable=True) for r in results
    ]
    if unavailable and not any(r.ok for r in final):
        raise unavailable[0]
    return final
