"""What Redis's replies to the adapter's XADDs mean: one result per message, and for an atomic
unit (its script's answer, or ``MULTI``, its XADDs, ``EXEC``) one verdict on the whole unit.

The script (``brokers.redis._script``) answers what it did: stored the unit, found it stored
before (each member acknowledged with its entry id, the receipt saying ``duplicate``), found
a key of the wrong type (nothing stored), or stored members until an XADD failed (the unit
fails, its error naming the members Redis stored). An error reply to the script itself means
it stored nothing: only its ``GET`` and ``TYPE`` can raise, and they come before any write.

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
from brokers._protocol import (
    OutgoingMessage,
    PublishResult,
    member_refused,
    unit_verdict,
    whole_unit,
)
from brokers.redis import _script

__all__ = [
    "UNAVAILABLE",
    "classify",
    "keys_denied",
    "receipt",
    "script_outcome",
    "scripting_refused",
    "unit_outcome",
    "unmarked",
]

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


def receipt(stream: str, entry_id: bytes | str, *, duplicate: bool = False) -> str:
    """XADD's answer, the entry id, with the stream it is in; ``duplicate``: the unit was
    stored before, by an earlier send whose answer was lost."""
    found: dict[str, object] = {"stream": stream, "id": _text(entry_id)}
    if duplicate:
        found["duplicate"] = True
    return orjson.dumps(found).decode()


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


def scripting_refused(exc: Exception) -> bool:
    """Whether an error reply to the unit's script says the script cannot run here, which
    stored nothing: not cached (``NOSCRIPT``), not allowed (``NOPERM``, to the command or a
    key), or any other refusal for good (an unknown command, ``GET`` or ``TYPE`` refused
    inside it). A unit so answered goes again by ``EVAL`` or ``MULTI``/``EXEC``."""
    if isinstance(exc, redis.exceptions.NoScriptError | redis.exceptions.NoPermissionError):
        return True
    return isinstance(exc, redis.exceptions.ResponseError) and not classify(exc).retryable


def keys_denied(exc: Exception) -> bool:
    """Whether the script was refused for one of its keys (a member's stream or the
    marker, Redis does not say which)."""
    return isinstance(exc, redis.exceptions.NoPermissionError) and "key" in str(exc).lower()


def script_outcome(unit: Sequence[OutgoingMessage], answer: Sequence[Any]) -> list[PublishResult]:
    """The verdict on one unit from its script's answer (``brokers.redis._script``)."""
    status, rest = answer[0], answer[1:]
    ids = [m.wire.message_id for m in unit]
    if status == _script.STORED_BEFORE:
        marked = _text(rest[0]).split()
        if len(marked) != len(unit):
            error = f"its marker holds {len(marked)} entry ids for a unit of {len(unit)}"
            return whole_unit(len(unit), PublishResult.failed(error, retryable=False))
        return _acked(unit, marked, duplicate=True)
    if status == _script.WRONG_TYPE:
        member, kind = rest[0] - 1, _text(rest[1])
        error = (
            f"rejected by Redis: WRONGTYPE {unit[member].destination} holds a {kind}, not a stream"
        )
        return member_refused(ids, member, error, retryable=False)
    if status == _script.STORED_IN_PART:
        failure, stored = classify(_error(rest[1])), rest[2:]  # rest[0]: the failed member
        members = [*_acked(unit, stored), failure]
        members += [PublishResult.acked()] * (len(unit) - len(members))
        verdict = unit_verdict(members, ids)
        return _stored_anyway(unit, stored, verdict, "a script does not roll back")
    if status == _script.STORED_UNMARKED:
        return _acked(unit, rest[1:])
    return _acked(unit, rest)


def unmarked(answer: Sequence[Any]) -> str | None:
    """Why the script stored the unit without its marker (``SET`` refused); else None."""
    return f"SET refused: {_text(answer[1])}" if answer[0] == _script.STORED_UNMARKED else None


def _acked(
    unit: Sequence[OutgoingMessage], entry_ids: Sequence[Any], *, duplicate: bool = False
) -> list[PublishResult]:
    return [
        PublishResult.acked(receipt(m.destination, entry_id, duplicate=duplicate))
        for m, entry_id in zip(unit, entry_ids, strict=False)
    ]


def _error(text: bytes | str) -> redis.exceptions.ResponseError:
    """An error a script caught (``redis.pcall``), as the client would have raised it."""
    return redis.exceptions.ResponseError(_text(text))


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
