"""What Redis's replies to the adapter's XADDs mean: one result per message, and for an atomic
unit (``MULTI``, its XADDs, ``EXEC``) one verdict on the whole unit.

Redis judges a transaction's commands twice, and only the first judgement is all or nothing.
A command refused when it is queued (its reply is an error instead of ``QUEUED``) makes
``EXEC`` discard the transaction: nothing is stored. A command that fails when ``EXEC`` runs
it fails alone (``EXEC``'s reply holds the error in its place) and the others stand: the unit
fails, and its error says which members Redis stored all the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
import redis.exceptions

from brokers._describe import describe
from brokers._protocol import OutgoingMessage, PublishResult, unit_verdict, whole_unit

__all__ = ["UNAVAILABLE", "classify", "receipt", "unit_outcome"]

UNAVAILABLE: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    ConnectionError,
    OSError,
)
# Error replies that pass: memory freed, a failover or a load finished, a slot moved.
_TRANSIENT: tuple[type[BaseException], ...] = (
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.AskError,
)
_TRANSIENT_PREFIXES = ("BUSY", "LOADING", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "OOM")
# EXEC refused the transaction for a reason of the moment: "... because of: OOM ...".
_ABORTED_BECAUSE = "because of: "
_QUEUED = PublishResult.acked()  # a member queued: EXEC's reply judges it


def receipt(stream: str, entry_id: bytes | str) -> str:
    """XADD's answer, the entry id, with the stream it is in."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return orjson.dumps({"stream": stream, "id": text}).decode()


def classify(exc: Exception) -> PublishResult:
    """One error reply as a result: cut off, worth another try, or refused for good."""
    if isinstance(exc, UNAVAILABLE):
        return PublishResult.cut_off(f"Redis unreachable: {describe(exc)}")
    reason = str(exc).rpartition(_ABORTED_BECAUSE)[2]
    if isinstance(exc, _TRANSIENT) or reason.startswith(_TRANSIENT_PREFIXES):
        return PublishResult.failed(f"Redis is busy: {describe(exc)}", retryable=True)
    if isinstance(exc, redis.exceptions.ResponseError):
        return PublishResult.failed(f"rejected by Redis: {describe(exc)}", retryable=False)
    if isinstance(exc, redis.exceptions.AuthenticationError):
        return PublishResult.failed(f"authentication refused: {describe(exc)}", retryable=False)
    return PublishResult.failed(f"Redis error: {describe(exc)}", retryable=True)


def unit_outcome(unit: Sequence[OutgoingMessage], replies: Sequence[Any]) -> list[PublishResult]:
    """The verdict on one unit from its replies: ``MULTI``'s, each XADD's, then ``EXEC``'s."""
    multi, queued, executed = replies[0], replies[1:-1], replies[-1]
    ids = [m.wire.message_id for m in unit]
    if isinstance(multi, Exception):
        # No transaction: each XADD ran as it came (QUEUED never came back).
        verdict = whole_unit(len(unit), classify(multi))
        return _stored_anyway(unit, queued, verdict, "Redis refused MULTI, so each XADD ran alone")
    refused = [classify(r) if isinstance(r, Exception) else _QUEUED for r in queued]
    if any(not r.ok for r in refused):  # EXEC discarded the transaction: nothing stored
        return unit_verdict(refused, ids)
    if isinstance(executed, Exception):  # EXEC refused as a whole: nothing stored
        return whole_unit(len(unit), classify(executed))
    members = [
        classify(r) if isinstance(r, Exception) else PublishResult.acked(receipt(m.destination, r))
        for m, r in zip(unit, executed, strict=True)
    ]
    verdict = unit_verdict(members, ids)
    return _stored_anyway(unit, executed, verdict, "a transaction does not roll back")


def _stored_anyway(
    unit: Sequence[OutgoingMessage], answers: Sequence[Any], verdict: list[PublishResult], why: str
) -> list[PublishResult]:
    """A failed ``verdict`` that also names the members Redis stored (an entry id among
    ``answers``), since the relay will count none of them as sent."""
    if all(r.ok for r in verdict):
        return verdict
    stored = [
        f"{i + 1} ({unit[i].destination} {_text(answer)})"
        for i, answer in enumerate(answers)
        if isinstance(answer, bytes | str)
    ]
    if not stored:
        return verdict
    members = "member" if len(stored) == 1 else "members"
    error = f"{verdict[0].error}; yet Redis stored {members} {', '.join(stored)} ({why})"
    return [PublishResult.failed(error, retryable=verdict[0].retryable)] * len(unit)


def _text(answer: bytes | str) -> str:
    return answer.decode() if isinstance(answer, bytes) else answer
