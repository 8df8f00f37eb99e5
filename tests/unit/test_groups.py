"""The failure-group normaliser on the error texts the router really stores: what the relay
writes (router/relay/delivery.py), what each adapter says of its broker's answer (built here
with the adapters' own classifiers), and the texts the other tests store."""

from __future__ import annotations

import aiormq.exceptions
import pytest
import redis.exceptions
from aiokafka import errors as kafka_errors

from brokers.kafka._adapter import _classify as kafka_outcome
from brokers.nats._acks import NO_STREAM, _outcome
from brokers.ordering import NOT_SENT
from brokers.rabbitmq._adapter import _classify as rabbitmq_outcome
from brokers.redis._replies import classify as redis_outcome
from router.ops.error_text import Signature, normalise, signature
from router.ops.groups import group_id


def jetstream(answer: bytes) -> str:
    """The error JetStream's answer to a publish leaves on a row."""
    error = _outcome(answer, no_responders=False).error
    assert error is not None
    return error


def error_of(outcome: object) -> str:
    error = getattr(outcome, "error", None)
    assert isinstance(error, str)
    return error


REFUSED = "partners: cannot connect to NATS: ConnectionRefusedError: [Errno 111] Connection refused"
PAYLOAD = b'{"error":{"code":400,"err_code":10054,"description":"maximum payload exceeded"}}'

CASES = [
    # README's `router status` with the partner broker down.
    (
        REFUSED,
        "ConnectionRefusedError",
        None,
        "partners: cannot connect to NATS: ConnectionRefusedError: [Errno <n>] Connection refused",
    ),
    # tests/integration/test_delivery.py: given up after its attempts, on the asyncio loop.
    (
        "gave up after 4 attempts: partner: cannot connect to NATS: ConnectionRefusedError: "
        "[Errno 111] Connect call failed ('127.0.0.1', 40321)",
        "ConnectionRefusedError",
        None,
        "partner: cannot connect to NATS: ConnectionRefusedError: [Errno <n>] Connect call "
        "failed <addr>",
    ),
    (
        "not retryable: " + jetstream(PAYLOAD),
        "rejected",
        "err_code 10054",
        "rejected by JetStream: maximum payload exceeded (code <n>, err_code <n>)",
    ),
    (
        jetstream(b'{"error":{"code":503,"err_code":10077,"description":"maximum messages"}}'),
        "error",
        "err_code 10077",
        "JetStream error: maximum messages (code <n>, err_code <n>)",
    ),
    (
        jetstream(b"<html>502</html>"),
        "error",
        None,
        "unreadable JetStream answer: <str>",
    ),
    (NO_STREAM.error, "error", None, NO_STREAM.error),
    (
        error_of(kafka_outcome(kafka_errors.MessageSizeTooLargeError())),
        "MessageSizeTooLargeError",
        "Error 10",
        "rejected by Kafka: MessageSizeTooLargeError: [Error <n>] MessageSizeTooLargeError",
    ),
    (
        error_of(kafka_outcome(kafka_errors.KafkaTimeoutError())),
        "KafkaTimeoutError",
        None,
        "Kafka error: KafkaTimeoutError",
    ),
    (
        error_of(
            rabbitmq_outcome(
                aiormq.exceptions.ChannelNotFoundEntity(
                    404, "NOT_FOUND - no exchange 'orders' in vhost '/'"
                )
            )
        ),
        "ChannelNotFoundEntity",
        "404 NOT_FOUND",
        'entity missing: ChannelNotFoundEntity: (<n>, "NOT_FOUND - no exchange <str> in vhost '
        '<str>")',
    ),
    (
        "unroutable: no queue is bound for routing key 'shop.order_placed' (NO_ROUTE)",
        "unroutable",
        "NO_ROUTE",
        "unroutable: no queue is bound for routing key <str> (NO_ROUTE)",
    ),
    (
        error_of(rabbitmq_outcome(TimeoutError())),
        "timeout",
        None,
        "no confirm within publish_timeout",
    ),
    (
        error_of(
            redis_outcome(redis.exceptions.ResponseError("WRONGTYPE Operation against a key"))
        ),
        "ResponseError",
        "WRONGTYPE",
        "rejected by Redis: ResponseError: WRONGTYPE Operation against a key",
    ),
    (
        error_of(
            redis_outcome(
                redis.exceptions.ConnectionError(
                    "Error 111 connecting to cache.internal:6390. Connection refused."
                )
            )
        ),
        "ConnectionError",
        None,
        "Redis unreachable: ConnectionError: Error <n> connecting to <addr>. Connection refused.",
    ),
    (
        "message too large for 'orders' (at most 262,144 bytes)",
        "error",
        None,
        "message too large for <str> (at most <n> bytes)",
    ),
    (
        "cannot render envelope: field 'total' is not JSON: Decimal('NaN')",
        "render",
        None,
        "cannot render envelope: field <str> is not JSON: Decimal(<str>)",
    ),
    (
        "cannot downcast: no downcaster from order_placed v3 to v2",
        "downcast",
        None,
        "cannot downcast: no downcaster from order_placed v3 to v2",
    ),
    (
        "lease ended before the attempt was marked (vm:w0:31278:49f98f)",
        "lease",
        None,
        "lease ended before the attempt was marked (<worker>)",
    ),
    (f"gave up after 10 attempts: {NOT_SENT}", "held", None, NOT_SENT),
    (
        "partner: broker did not answer within the timeout",
        "timeout",
        None,
        "partner: broker did not answer within the timeout",
    ),
    # tests/unit/test_processor.py and tests/integration/test_operations.py.
    ("gave up after 3 attempts: refused 1", "error", None, "refused <n>"),
    ("connection REFUSED again", "error", None, "connection REFUSED again"),
    (None, "error", None, ""),
]


@pytest.mark.parametrize(("text", "error_class", "code", "message"), CASES)
def test_signature_of_a_stored_error(
    text: str | None, error_class: str, code: str | None, message: str
) -> None:
    assert signature(text) == Signature(error_class, code, message)


@pytest.mark.parametrize(
    ("one", "other"),
    [
        # Ports, attempt counts and the relay's prefixes vary between rows of one failure.
        (
            "partner: cannot connect to NATS: ConnectionRefusedError: [Errno 111] Connect call "
            "failed ('127.0.0.1', 40321)",
            "gave up after 10 attempts: partner: cannot connect to NATS: "
            "ConnectionRefusedError: [Errno 111] Connect call failed ('127.0.0.1', 4222)",
        ),
        (
            "lease ended before the attempt was marked (paused-worker)",
            "lease ended before the attempt was marked (vm:31278:49f98f)",
        ),
        (
            "Service Bus error: ServiceBusError: Handler failed: tracking id "
            "5f2c9a7e-1b2c-4d3e-8f90-a1b2c3d4e5f6",
            "Service Bus error: ServiceBusError: Handler failed: tracking id "
            "0b4e33a1-77c2-4a1e-9c0d-112233445566",
        ),
        (
            "Kafka error: KafkaConnectionError: Unable to bootstrap from "
            '[("localhost", 9092, <AddressFamily.AF_UNSPEC: 0>)]',
            "Kafka error: KafkaConnectionError: Unable to bootstrap from "
            '[("kafka-2.internal", 19092, <AddressFamily.AF_INET: 2>)]',
        ),
        ("stream 'T1A2B' sealed at sequence 0x1f3a", "stream 'T9Z9Z' sealed at sequence 0x2c"),
    ],
)
def test_rows_of_one_failure_share_a_signature(one: str, other: str) -> None:
    assert signature(one) == signature(other)


def test_different_failures_differ() -> None:
    assert len({signature(case[0]) for case in CASES}) == len(CASES)


def test_group_ids_are_short_stable_and_per_database_and_target() -> None:
    sig = signature(REFUSED)
    first = group_id("main", "partner", sig)
    assert len(first) == 10 and int(first, 16) >= 0
    assert group_id("main", "partner", signature(f"gave up after 3 attempts: {REFUSED}")) == first
    assert group_id("billing", "partner", sig) != first
    assert group_id("main", "analytics", sig) != first


def test_normalise_keeps_what_names_the_failure() -> None:
    assert normalise("no exchange 'orders' on nats://user:pw@10.0.0.7:4222 after 3.5 s") == (
        "no exchange <str> on <addr> after <n> s"
    )
    assert normalise("utf8mb4 column v2 of shop.order_placed") == (
        "utf8mb4 column v2 of shop.order_placed"
    )
