"""``router serve`` killed with SIGKILL after JetStream stored an atomic unit and before the
router saw the answer: the next router sends the unit again, JetStream recognises it (error
10201: its members' ``Nats-Msg-Id``s are in the stream's duplicate window), and the rows are
marked published. The stream holds the unit once."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import asyncpg
import nats
import yaml

from brokers.nats import EmbeddedNats
from router import Outbox, load_config
from tests.chaos.proxy import DelayingProxy
from tests.e2e.helpers import Serving
from tests.integration.events import OrderPlaced
from tests.services import free_port

STREAM, SUBJECT = "KILLED", "killed"


def write_config(folder: Path, database: str, nats_url: str) -> None:
    broker = {
        "type": "nats",
        "internal": True,
        "atomic": True,
        "url": nats_url,
        "destination": SUBJECT + ".{event_type}",
        "stream": {"name": STREAM, "subjects": [SUBJECT + ".>"]},
    }
    config = {
        "databases": {"main": database},
        "brokers": {"events": broker},
        "outbox": {"lease_seconds": 5},
        "http": {"enabled": False},
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(config))


async def stage(folder: Path, keys: list[str]) -> list[str]:
    """One transaction, an event on each key; their ids."""
    outbox = Outbox(load_config(folder / "config.yaml"))
    try:
        async with outbox.transaction() as tx:
            return await tx.stage(
                *(OrderPlaced(order_id=key, total=Decimal(1)) for key in keys), stream_keys=keys
            )
    finally:
        await outbox.close()


async def stored(url: str, count: int, timeout: float = 10) -> list[dict[str, Any]]:
    """The stream's messages once it holds ``count`` (their headers and sequence)."""
    client = await nats.connect(url)
    try:
        js = client.jetstream()
        deadline = time.monotonic() + timeout
        while (await js.stream_info(STREAM)).state.messages < count:
            assert time.monotonic() < deadline, "the stream did not fill"
            await asyncio.sleep(0.05)
        info = await js.stream_info(STREAM)
        found = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            message = await js.get_msg(STREAM, seq)
            found.append({"seq": seq, **dict(message.headers or {})})
        return found
    finally:
        await client.close()


async def statuses(database: str, column: str = "status") -> dict[str, str]:
    conn = await asyncpg.connect(database)
    try:
        rows = await conn.fetch(f"SELECT message_id::text, {column} FROM router_outbox")
    finally:
        await conn.close()
    return {r[0]: r[1] for r in rows}


async def published(database: str, ids: list[str], timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = await statuses(database)
        if all(found.get(i) == "published" for i in ids):
            return True
        await asyncio.sleep(0.1)
    return False


async def test_a_unit_stored_before_serve_was_killed_is_stored_once_after_the_restart(
    pg_url: str, tmp_path: Path
) -> None:
    nats_url = f"nats://127.0.0.1:{free_port()}"
    server = EmbeddedNats(nats_url, tmp_path / "nats")  # atomic batches: nats-server 2.12+
    await server.start()
    proxy = DelayingProxy("127.0.0.1", int(nats_url.rsplit(":", 1)[1]), 0.0)
    await proxy.start()
    serving: Serving | None = None
    try:
        write_config(tmp_path, pg_url, f"nats://127.0.0.1:{proxy.port}")
        serving = Serving(tmp_path, None, new_session=True)
        warm = await stage(tmp_path, ["w"])  # connected, its stream made, through the proxy
        assert await published(pg_url, warm)
        proxy.mute()  # from now on JetStream's answers are lost on the way
        unit = await stage(tmp_path, ["a", "b", "c"])
        before = await stored(nats_url, 4)  # the unit is stored: its commit was answered
        os.killpg(serving.process.pid, signal.SIGKILL)
        serving.stop()
        assert {s for i, s in (await statuses(pg_url)).items() if i in unit} == {"pending"}

        write_config(tmp_path, pg_url, nats_url)  # the path to NATS is whole again
        serving = Serving(tmp_path, None, new_session=True)
        assert await published(pg_url, unit), serving.log.read_text()
        after = await stored(nats_url, 4)
        receipts = await statuses(pg_url, "receipt")
    finally:
        if serving is not None:
            serving.stop()
        await proxy.stop()
        await server.stop()

    assert after == before  # nothing stored a second time
    members = [m for m in after if m["Nats-Msg-Id"] in unit]
    assert [m["Nats-Msg-Id"] for m in members] == unit
    assert len({m["Nats-Batch-Id"] for m in members}) == 1
    assert "batch.failures" not in serving.log.read_text()
    # Marked published on JetStream's word that the batch was stored before (10201).
    assert all('"batch_stored":true' in receipts[i] for i in unit), receipts
