"""Keeping each stream in order while messages are in flight together.

- ``publish_in_order``: for brokers whose client confirms one message at a time (RabbitMQ,
  Kafka through FastStream): messages of one stream key are sent one after the other, in batch
  order, and a stream stops at its first failure; other streams and keyless messages go
  concurrently, at most ``concurrency`` at once.
- ``waves``: for brokers that take many messages in one round trip (a Redis pipeline, the
  processor's waves): the n-th message of every stream goes in wave n, so no wave holds two
  messages of one stream, and a stream can stop at a failed message before its next wave.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import TypeVar

from brokers._protocol import OutgoingMessage, PublishResult
from envelopes import BrokerUnavailable

__all__ = ["NOT_SENT", "publish_in_order", "waves"]

T = TypeVar("T")

Send = Callable[[OutgoingMessage], Awaitable[str | None]]
Classify = Callable[[Exception], PublishResult]

NOT_SENT = "not sent: an earlier message of its stream failed"


async def publish_in_order(
    batch: Sequence[OutgoingMessage], send: Send, classify: Classify, *, concurrency: int
) -> list[PublishResult]:
    """Send every message; one result per message, in batch order.

    ``send`` returns once the broker confirmed the message (with the broker's receipt, or
    None when it gives none), or raises. ``classify`` turns an
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
                receipt = await send(batch[index])
            except BrokerUnavailable as exc:
                unavailable.append(exc)
                results[index] = PublishResult.cut_off(str(exc))
                return False
            except Exception as exc:  # the adapter's classify decides what it means
                results[index] = classify(exc)
                return False
            results[index] = PublishResult.acked(receipt)
            return True

    async def chain(indexes: list[int]) -> None:
        for position, index in enumerate(indexes):
            if not await one(index):
                for later in indexes[position + 1 :]:
                    results[later] = PublishResult.failed(NOT_SENT, retryable=True)
                return

    keyless = chains.pop(None, [])
    await asyncio.gather(*(one(i) for i in keyless), *(chain(c) for c in chains.values()))
    final = [
        r if r is not None else PublishResult.failed(NOT_SENT, retryable=True) for r in results
    ]
    if unavailable and not any(r.ok for r in final):
        raise unavailable[0]
    return final


def waves(items: Sequence[T], key: Callable[[T], Hashable | None]) -> list[list[T]]:
    """Split ``items`` so that no wave holds two of one key (``None``: no key); order is kept
    within each wave, and the n-th item of a key is in wave n."""
    result: list[list[T]] = []
    depth: dict[Hashable, int] = {}
    for item in items:
        level = 0
        k = key(item)
        if k is not None:
            level = depth.get(k, 0)
            depth[k] = level + 1
        if level == len(result):
            result.append([])
        result[level].append(item)
    return result
