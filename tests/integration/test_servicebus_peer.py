"""The Service Bus peer's duplicate detection, driven by the Azure SDK's sender: on an entity
that has it, a message id stored within the window is accepted and dropped, each message of a
batch on its own; an entity without it stores every message."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage

from tests.peers.servicebus import ServiceBusPeer, ServiceBusPeerProcess
from tests.services import free_port

# An entity per test, so one peer serves them all (each test starts with an empty history).
WINDOWS = {"repeat": 60.0, "distinct": 60.0, "batch": 60.0, "brief": 0.5}


@pytest.fixture(scope="module")
def peer() -> Iterator[ServiceBusPeer]:
    """A peer with duplicate detection on for ``WINDOWS``; the shared one has it on nowhere."""
    peer = ServiceBusPeer(port=free_port(), duplicate_detection=WINDOWS)
    peer.start()
    yield peer
    peer.stop()


def send(peer: ServiceBusPeer, entity: str, *batches: list[str]) -> None:
    """Send each list of message ids as one SDK batch (one transfer), in order."""
    with (
        ServiceBusClient.from_connection_string(peer.connection_string) as client,
        client.get_queue_sender(entity) as sender,
    ):
        for ids in batches:
            batch = sender.create_message_batch()
            for message_id in ids:
                batch.add_message(ServiceBusMessage(message_id.encode(), message_id=message_id))
            sender.send_messages(batch)


def stored(peer: ServiceBusPeer, entity: str) -> list[str | None]:
    return [m.message_id for m in peer.messages(entity)]


def test_a_repeated_message_id_is_accepted_and_stored_once(peer: ServiceBusPeer) -> None:
    send(peer, "repeat", ["a"], ["a"])
    assert stored(peer, "repeat") == ["a"]


def test_different_message_ids_are_all_stored(peer: ServiceBusPeer) -> None:
    send(peer, "distinct", ["a"], ["b"])
    assert stored(peer, "distinct") == ["a", "b"]


def test_a_batch_is_checked_message_by_message(peer: ServiceBusPeer) -> None:
    send(peer, "batch", ["a"], ["a", "b", "b", "c"])
    assert stored(peer, "batch") == ["a", "b", "c"]


def test_an_entity_without_duplicate_detection_stores_every_message(
    peer: ServiceBusPeer,
) -> None:
    send(peer, "plain", ["a"], ["a"])
    assert stored(peer, "plain") == ["a", "a"]


def test_a_message_id_is_stored_again_once_the_window_passed(peer: ServiceBusPeer) -> None:
    send(peer, "brief", ["a"])
    time.sleep(0.6)  # the window is 0.5 s
    send(peer, "brief", ["a"])
    assert stored(peer, "brief") == ["a", "a"]


def test_the_peer_in_a_process_of_its_own_drops_repeats_too() -> None:
    peer = ServiceBusPeerProcess(port=free_port(), duplicate_detection=WINDOWS)
    peer.start()
    try:
        send(peer, "repeat", ["a"], ["a", "b"])
        send(peer, "plain", ["a"], ["a"])
        assert stored(peer, "repeat") == ["a", "b"]
        assert stored(peer, "plain") == ["a", "a"]
    finally:
        peer.stop()
