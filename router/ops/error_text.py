"""What an error text says: the error class, the broker's error code, and the message with
what varies between rows (numbers, ids, quoted names, addresses) taken out. Failure groups
(``router.ops.groups``) are the rows whose texts say the same."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Signature", "normalise", "signature"]


@dataclass(frozen=True)
class Signature:
    """What one error text says, with what varies between rows taken out."""

    error_class: str
    code: str | None
    message: str


# What the relay puts before a broker's error when it gives a row up
# (router/relay/delivery.py, Delivery._classify).
_RELAY_PREFIX = re.compile(r"^(?:gave up after \d+ attempts: |not retryable: )+")
# A name that says it is an exception; else a CamelCase name in the ``Name: message`` shape
# of brokers._describe.describe (aiormq's ChannelNotFoundEntity...).
_CLASSES = (
    re.compile(r"\b[A-Z][A-Za-z0-9]*(?:Error|Exception|Refused|Exceeded|Timeout|Failure)\b"),
    re.compile(r"(?:^|(?<=: ))[A-Z][a-z0-9]+(?:[A-Z][A-Za-z0-9]*)+(?=: |$)"),
)
# When the text names no exception: what the router itself says, first match wins.
_CATEGORIES = (
    ("rejected by ", "rejected"),
    ("cannot render envelope", "render"),
    ("cannot downcast", "downcast"),
    ("lease ended", "lease"),
    ("unroutable", "unroutable"),
    ("an earlier message of its stream failed", "held"),
    ("within the timeout", "timeout"),
    ("no confirm within", "timeout"),
)
_CODES = (
    # JetStream: "(code 400, err_code 10054)"; the err_code is the precise one.
    (re.compile(r"\berr_code (\d+)"), "err_code {}"),
    (re.compile(r"\bcode (\d+)\b"), "code {}"),
    # AMQP 0-9-1 (aiormq): '(404, "NOT_FOUND - no exchange ...")'; a returned message's
    # reply text alone: "(NO_ROUTE)".
    (re.compile(r"\((\d{3}), ['\"]([A-Z]+(?:_[A-Z]+)*)\b"), "{} {}"),
    (re.compile(r"\(([A-Z]+(?:_[A-Z]+)+)\)"), "{}"),
    # AMQP 1.0 (Service Bus): "amqp:not-found", "com.microsoft:entity-disabled".
    (re.compile(r"\b((?:amqp|com\.microsoft):[a-z-]+(?::[a-z-]+)*)"), "{}"),
    # Kafka (aiokafka): "[Error 10] MessageSizeTooLargeError"; librdkafka: "code=MSG_SIZE...".
    (re.compile(r"\[Error (\d+)\]"), "Error {}"),
    (re.compile(r"\bcode=([A-Z_]+)\b"), "{}"),
    # Redis: the reply's first word, "rejected by Redis: ResponseError: WRONGTYPE Operation...".
    (re.compile(r"\bRedis\b[^:]*: \w+Error: ([A-Z][A-Z_]{2,})\b"), "{}"),
)
_PLACEHOLDERS = (
    (re.compile(r"(lease ended before the attempt was marked) \(.*\)"), r"\1 (<worker>)"),
    (re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s'\"()\[\],]+"), "<addr>"),
    # A socket address as Python prints it: ('127.0.0.1', 4222), ("h", 9092, <family>).
    (re.compile(r"\(\s*['\"][^'\"]*['\"],\s*\d+\s*(?:,[^()]*)?\)"), "<addr>"),
    (
        re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|\b(?=[\w.-]*[A-Za-z.])[A-Za-z0-9][\w.-]*):\d{1,5}\b"),
        "<addr>",
    ),
    (re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}\b"), "<addr>"),
    (re.compile(r"\b[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}\b"), "<id>"),
    # Quoted names and values (no spaces: a quoted sentence is part of the message).
    (re.compile(r"\bb'[^'\n]*'|\bb\"[^\"\n]*\""), "<str>"),
    (re.compile(r"'[^'\s]*'|\"[^\"\s]*\""), "<str>"),
    (re.compile(r"\b0x[0-9a-fA-F]+\b"), "<id>"),
    (re.compile(r"\b(?=[0-9a-fA-F]*[a-fA-F])(?=[0-9a-fA-F]*\d)[0-9a-fA-F]{6,}\b"), "<id>"),
    (re.compile(r"\b(?=[\w-]*\d)(?=[\w-]*[A-Za-z])[A-Za-z0-9_-]{16,}\b"), "<id>"),
    (re.compile(r"(?<![\w<])\d+(?:[.,]\d+)*(?![\w>])"), "<n>"),
)


def signature(error: str | None) -> Signature:
    """The error class, broker error code and normalised message of one ``last_error``."""
    text = " ".join(_RELAY_PREFIX.sub("", (error or "").strip()).split())
    return Signature(_class(text), _code(text), normalise(text))


def _class(text: str) -> str:
    for pattern in _CLASSES:
        found = pattern.search(text)
        if found:
            return found.group(0)
    lowered = text.lower()
    return next((category for part, category in _CATEGORIES if part in lowered), "error")


def _code(text: str) -> str | None:
    for pattern, shape in _CODES:
        found = pattern.search(text)
        if found:
            return shape.format(*found.groups())
    return None


def normalise(text: str) -> str:
    """``text`` with numbers, ids, quoted names and addresses replaced by placeholders."""
    for pattern, placeholder in _PLACEHOLDERS:
        text = pattern.sub(placeholder, text)
    return text
