"""A traceparent from OpenTelemetry's context travels to the broker's headers."""

from __future__ import annotations

from pathlib import Path

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from brokers import MemoryBroker
from router import Event, Outbox, Processor
from router.config import DatabaseSettings
from router.ops.migrate import upgrade
from router.relay.store.sqlite import SqliteStore
from tests.conftest import make_config


class Traced(Event, type="traced", published=True):
    n: int


async def test_the_active_span_becomes_the_messages_traceparent(tmp_path: Path) -> None:
    await upgrade("main", DatabaseSettings.model_validate({"url": "sqlite:///o.db"}), tmp_path)
    config = make_config(
        {"main": "sqlite:///o.db"},
        {"events": {"type": "memory", "internal": True}, "partner": {"type": "memory"}},
        base_dir=tmp_path,
    )
    outbox = Outbox(config)
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("checkout") as span:
        async with outbox.transaction() as tx:
            await tx.stage(Traced(n=1))
        context = span.get_span_context()
    async with outbox.transaction() as tx:  # outside any span: none
        await tx.stage(Traced(n=2))
    await outbox.close()

    store = SqliteStore("main", tmp_path / "o.db")
    received = {}
    for target in ("events", "partner"):
        broker = MemoryBroker(target)
        processor = Processor(
            database="main",
            target=target,
            settings=config.brokers[target],
            broker=broker,
            store=store,
            outbox=config.outbox,
            worker_id="w",
        )
        await processor.drain()
        received[target] = broker.messages
    await store.close()

    expected = f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"
    for messages in received.values():
        assert messages[0].wire.headers["traceparent"] == expected
        assert "traceparent" not in messages[1].wire.headers
    assert trace.get_current_span().get_span_context().is_valid is False
