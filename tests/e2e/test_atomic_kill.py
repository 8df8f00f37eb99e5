"""``router serve`` killed with SIGKILL in the middle of a unit's write stores nothing of the
unit, and the next router stores it once, whole (``DelayingProxy.stall_at`` holds what follows
the cut): on JetStream the batch's members reached the server and its commit did not; on
Redis the script's command, and on Service Bus the batch's transfer, were half sent.

``router serve`` killed with SIGKILL after the broker stored an atomic unit and before the
router saw the answer (the answers are lost on the way: ``DelayingProxy.mute``).

The next router sends the unit again, the broker recognises it, and the rows are marked
published: the stream holds the unit once. JetStream by error 10201 (its members'
``Nats-Msg-Id``s are in the stream's duplicate window); Redis by the unit's marker, which the
script that stored it set (docs/guarantees.md, "Atomic transactions").

On Service Bus the next router sends the unit again with the same message ids, and the test
peer, emulating an entity with duplicate detection on, accepts the batch and drops every
member. That proves the adapter's side (the same ids, sent as one batch, marked published on
the send's acceptance); that Azure's server drops them is Azure's documented behaviour, which
this test does not exercise."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import asyncpg
import nats
import orjson
import pytest
import redis.asyncio as aioredis
import yaml

from brokers.nats import EmbeddedNats
from brokers.nats._settings import BATCH_COMMIT
from router import Outbox, load_config
from tests.chaos.proxy import DelayingProxy
from tests.contract.harnesses import REDIS_URL
from tests.e2e.helpers import Serving
from tests.integration.events import OrderPlaced
from tests.peers.servicebus import CONNECTION_STRING, ServiceBusPeer
from tests.services import free_port

STREAM, SUBJECT = "KILLED", "killed"


def nats_broker(url: str) -> dict[str, Any]:
    return {
        "type": "nats",
        "url": url,
        "destination": SUBJECT + ".{event_type}",
        "stream": {"name": STREAM, "subjects": [SUBJECT + ".>"]},
    }


def write_config(folder: Path, database: str, broker: dict[str, Any]) -> None:
    broker = {**broker, "internal": True, "atomic": True}
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


async def killed_after_storing(
    folder: Path, database: str, proxy: DelayingProxy
) -> tuple[list[str], Serving]:
    """Serve through ``proxy``; once a first event is published, mute the broker's answers,
    stage a unit of three, and SIGKILL serve once the broker holds the unit (``stored``,
    waited for by the caller's check below: 4 messages). The unit's ids, and the dead serve."""
    serving = Serving(folder, None, new_session=True)
    warm = await stage(folder, ["w"])  # connected, its stream made, through the proxy
    assert await published(database, warm), serving.log.read_text()
    proxy.mute()  # from now on the broker's answers are lost on the way
    unit = await stage(folder, ["a", "b", "c"])
    await asyncio.sleep(1.0)  # the unit goes out; its answer never comes back
    os.killpg(serving.process.pid, signal.SIGKILL)
    serving.stop()
    assert {s for i, s in (await statuses(database)).items() if i in unit} == {"pending"}
    return unit, serving


class Side:
    """A broker the router reaches through a proxy: where the proxy forwards to, the broker's
    config for a port (the proxy's or the broker's own), and what its destination holds."""

    cut: tuple[bytes, bytes | None]
    """Where ``DelayingProxy.stall_at`` cuts the unit's write: after its first member."""

    port: int
    """Where the broker listens (what the proxy forwards to)."""

    async def start(self) -> None:
        """Start what the test needs."""
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    def broker(self, port: int) -> dict[str, Any]:
        raise NotImplementedError

    async def contents(self) -> list[tuple[str, str | None]]:
        """The destination's messages in order: each one's id, and its batch (JetStream)."""
        raise NotImplementedError


CUT_KEY = "cut-here"  # the stream key of the unit's second member


class NatsSide(Side):
    # The members reach nats-server; the frame carrying Nats-Batch-Commit, and all after it,
    # does not.
    cut = (BATCH_COMMIT.encode(), b"HPUB ")

    def __init__(self, folder: Path) -> None:
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.server = EmbeddedNats(self.url, folder / "nats")

    async def start(self) -> None:
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop()

    def broker(self, port: int) -> dict[str, Any]:
        return nats_broker(f"nats://127.0.0.1:{port}")

    async def contents(self) -> list[tuple[str, str | None]]:
        found = await stored(self.url, 0)
        return [(m["Nats-Msg-Id"], m.get("Nats-Batch-Id")) for m in found]


class RedisSide(Side):
    cut = (CUT_KEY.encode(), None)  # the script's command, half sent

    port = 6379

    def __init__(self, folder: Path) -> None:
        self.destination = f"killed{uuid.uuid4().hex[:8]}"

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        client = aioredis.Redis.from_url(REDIS_URL)
        await client.delete(self.destination + ".order_placed")
        await client.aclose()

    def broker(self, port: int) -> dict[str, Any]:
        return {
            "type": "redis",
            "destination": self.destination + ".{event_type}",
            "url": f"redis://127.0.0.1:{port}/0",
        }

    async def contents(self) -> list[tuple[str, str | None]]:
        return [(i, None) for i in await entries(self.destination + ".order_placed")]


class ServiceBusSide(Side):
    cut = (CUT_KEY.encode(), None)  # the batch's transfer, half sent
    entity = "killed-order_placed"

    def __init__(self, folder: Path) -> None:
        self.peer = ServiceBusPeer(port=free_port())
        self.port = self.peer.port

    async def start(self) -> None:
        self.peer.start()

    async def stop(self) -> None:
        self.peer.stop()

    def broker(self, port: int) -> dict[str, Any]:
        return {
            "type": "servicebus",
            "destination": "killed-{event_type}",
            "connection_string": CONNECTION_STRING.format(port=port),
        }

    async def contents(self) -> list[tuple[str, str | None]]:
        return [(str(m.message_id), None) for m in self.peer.messages(self.entity)]


SIDES: dict[str, Callable[[Path], Side]] = {
    "nats": NatsSide,
    "redis": RedisSide,
    "servicebus": ServiceBusSide,
}


@pytest.mark.parametrize("kind", sorted(SIDES))
async def test_a_unit_whose_write_a_kill_cut_in_the_middle_is_stored_once_and_whole(
    kind: str, pg_url: str, tmp_path: Path
) -> None:
    side = SIDES[kind](tmp_path)
    await side.start()
    proxy = DelayingProxy("127.0.0.1", side.port, 0.0)
    await proxy.start()
    serving: Serving | None = None
    try:
        write_config(tmp_path, pg_url, side.broker(proxy.port))
        serving = Serving(tmp_path, None, new_session=True)
        warm = await stage(tmp_path, ["w"])
        assert await published(pg_url, warm), serving.log.read_text()
        proxy.stall_at(*side.cut)
        unit = await stage(tmp_path, ["a", CUT_KEY, "c"])
        deadline = time.monotonic() + 10
        while not proxy.stalled:  # kill before the relay gives up on the answer and resends
            assert time.monotonic() < deadline, "the unit's write never came"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # what came before the cut reaches the broker
        os.killpg(serving.process.pid, signal.SIGKILL)
        serving.stop()
        await proxy.stop()  # what was held goes with the dead connection
        await asyncio.sleep(0.5)
        cut = await side.contents()
        assert {s for i, s in (await statuses(pg_url)).items() if i in unit} == {"pending"}
        write_config(tmp_path, pg_url, side.broker(side.port))
        serving = Serving(tmp_path, None, new_session=True)
        assert await published(pg_url, unit), serving.log.read_text()
        after = await side.contents()
    finally:
        if serving is not None:
            serving.stop()
        await proxy.stop()
        await side.stop()

    assert [i for i, _ in cut] == warm  # nothing of the cut unit was stored
    assert [i for i, _ in after] == warm + unit  # then the unit, once, whole, together
    assert len({batch for _, batch in after[1:]}) == 1


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
        write_config(tmp_path, pg_url, nats_broker(f"nats://127.0.0.1:{proxy.port}"))
        unit, serving = await killed_after_storing(tmp_path, pg_url, proxy)
        before = await stored(nats_url, 4)
        write_config(tmp_path, pg_url, nats_broker(nats_url))  # the path is whole again
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


async def test_on_redis_a_unit_stored_before_serve_was_killed_is_stored_once_after_the_restart(
    pg_url: str, tmp_path: Path
) -> None:
    destination = f"killed{uuid.uuid4().hex[:8]}"
    broker = {"type": "redis", "destination": destination + ".{event_type}"}
    proxy = DelayingProxy("127.0.0.1", 6379, 0.0)
    await proxy.start()
    serving: Serving | None = None
    key = destination + ".order_placed"
    try:
        write_config(tmp_path, pg_url, broker | {"url": f"redis://127.0.0.1:{proxy.port}/0"})
        unit, serving = await killed_after_storing(tmp_path, pg_url, proxy)
        before = await entries(key)
        write_config(tmp_path, pg_url, broker | {"url": REDIS_URL})
        serving = Serving(tmp_path, None, new_session=True)
        assert await published(pg_url, unit), serving.log.read_text()
        after = await entries(key)
        receipts = await statuses(pg_url, "receipt")
        ids = await entry_ids(key)
    finally:
        if serving is not None:
            serving.stop()
        await proxy.stop()
        client = aioredis.Redis.from_url(REDIS_URL)
        await client.delete(key)
        await client.aclose()

    assert before[1:] == unit  # stored whole before the kill (after the first event)
    assert after == before  # and not again by the next router
    assert "batch.failures" not in serving.log.read_text()
    # Marked published on the marker's word: each member's entry id from the first storing.
    assert [orjson.loads(receipts[i]) for i in unit] == [
        {"stream": key, "id": entry_id, "duplicate": True} for entry_id in ids[1:]
    ]


async def entries(key: str) -> list[str]:
    """The message ids in a Redis stream, in order."""
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        found = await client.xrange(key) or []
    finally:
        await client.aclose()
    return [str(fields["message-id"]) for _, fields in found if fields]


async def entry_ids(key: str) -> list[str]:
    """The entry ids in a Redis stream, in order."""
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        found = await client.xrange(key) or []
    finally:
        await client.aclose()
    return [str(entry_id) for entry_id, _ in found]


async def test_on_service_bus_a_unit_stored_before_serve_was_killed_is_stored_once_after_the_restart(
    pg_url: str, tmp_path: Path
) -> None:
    entity = "killed-order_placed"
    peer = ServiceBusPeer(port=free_port(), duplicate_detection={entity: 120.0})
    peer.start()
    broker = {"type": "servicebus", "destination": "killed-{event_type}"}
    proxy = DelayingProxy("127.0.0.1", peer.port, 0.0)
    await proxy.start()
    serving: Serving | None = None
    try:
        through_proxy = CONNECTION_STRING.format(port=proxy.port)
        write_config(tmp_path, pg_url, broker | {"connection_string": through_proxy})
        unit, serving = await killed_after_storing(tmp_path, pg_url, proxy)
        before = [m.message_id for m in await asyncio.to_thread(peer.wait_for, entity, 4)]
        write_config(tmp_path, pg_url, broker | {"connection_string": peer.connection_string})
        serving = Serving(tmp_path, None, new_session=True)
        assert await published(pg_url, unit), serving.log.read_text()
        after = [m.message_id for m in peer.messages(entity)]
    finally:
        if serving is not None:
            serving.stop()
        await proxy.stop()
        peer.stop()

    assert before[1:] == unit  # stored whole before the kill (after the first event)
    assert after == before  # the batch sent again was accepted, and its members dropped
    assert "batch.failures" not in serving.log.read_text()
