"""``router preview`` on the shipped config: what each target would receive, sent nowhere."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import yaml

from envelopes import INTERNAL_ONLY_FIELDS
from tests.conftest import NatsStreams, nats_broker
from tests.e2e.helpers import ROOT, Serving, python, router


def test_a_partner_preview_shows_its_destination_headers_and_external_body() -> None:
    result = router(
        "preview",
        "order_placed",
        "--target",
        "partners",
        "--header",
        "x-secret=s",
        "--json",
        cwd=ROOT,
    )

    assert result.returncode == 0, result.stderr
    [message] = json.loads(result.stdout)
    assert (message["target"], message["kind"], message["profile"]) == (
        "partners",
        "nats",
        "external",
    )
    assert message["destination"] == "partners.order_placed"
    assert message["headers"]["event-type"] == "order_placed"
    assert message["headers"]["message-id"] == message["body"]["id"]
    assert message["headers"]["Nats-Msg-Id"] == message["body"]["id"]  # the adapter's too
    assert "x-secret" not in message["headers"]
    assert not set(message["body"]) & INTERNAL_ONLY_FIELDS
    # The example comes from the fields' examples in examples/shop/events.py.
    assert message["body"]["payload"] == {
        "order_id": "7c3fb8ef-bb1a-49f7-a3c3-00d539e5fb6e",
        "customer": "ada@example.com",
        "total": "42.50",
    }


def test_all_targets_side_by_side_mark_what_a_target_does_not_get() -> None:
    result = router(
        "preview",
        "order_placed",
        "--all-targets",
        "--payload",
        '{"order_id": "o-1", "customer": "c", "total": "1.00"}',
        cwd=ROOT,
    )

    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["events", "(nats)", "partners", "(nats)"]
    rows = {line.split()[0] + " " + line.split()[1]: line.split()[2:] for line in lines[2:]}
    assert rows["destination shop.order_placed"] == ["partners.order_placed"]
    assert rows["body payload.order_id"] == ["o-1", "o-1"]
    assert rows["body event_class"] == ["examples.shop.events.OrderPlaced", "-"]
    assert rows["body sequence"] == ["1", "-"]


def test_a_preview_after_a_gap_names_it_in_the_header_and_the_internal_body() -> None:
    gap = ["01a20935-b120-70ec-a2ef-2ad62ecc67f0", "01a20935-b120-70ec-a2ef-2ad62ecc67f1"]
    args = ["--stream-key", "o-1", "--skipped", gap[0], "--skipped", gap[1], "--json"]
    result = router("preview", "order_placed", "--all-targets", *args, cwd=ROOT)

    assert result.returncode == 0, result.stderr
    internal, partner = sorted(json.loads(result.stdout), key=lambda m: m["target"])
    assert (internal["target"], partner["target"]) == ("events", "partners")
    for message in (internal, partner):
        assert message["headers"]["skipped-message-ids"] == ",".join(gap)
    assert internal["body"]["skipped"] == gap
    assert "skipped" not in partner["body"]  # a partner reads the header


def test_what_preview_cannot_show_is_a_one_line_error() -> None:
    cases = {
        ("nope",): "router: unknown event type 'nope'; known types: order_placed, stock_reserved",
        ("stock_reserved", "--target", "partners"): "router: target 'partners' does not "
        "receive 'stock_reserved': the event is not published (published=True), so only the "
        "internal broker gets it",
        ("order_placed", "--target", "billing"): "router: unknown target 'billing'; "
        "configured: ['events', 'partners']",
        ("order_placed", "--payload", '{"order_id": 5}'): "router: --payload is not a valid "
        "order_placed: order_id: Input should be a valid string; customer: Field required; "
        "total: Field required",
        ("order_placed", "--header", "novalue"): "router: --header takes NAME=VALUE, got 'novalue'",
        ("order_placed", "--skipped", "01a20935-b120-70ec-a2ef-2ad62ecc67f0"): "router: a gap "
        "is in a stream: give --stream-key with --skipped",
        ("order_placed", "--stream-key", "o-1", "--skipped", "nope"): "router: --skipped takes "
        "message ids; got ['nope']",
    }
    for args, message in cases.items():
        result = router("preview", *args, cwd=ROOT)
        assert (result.returncode, result.stderr.strip(), result.stdout) == (2, message, ""), args


def shop_copy(folder: Path, partners: dict[str, Any]) -> Path:
    """The shipped example in ``folder``, its partners broker with ``partners`` added."""
    shutil.copytree(ROOT / "examples", folder / "examples")
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    config["brokers"]["partners"].update(partners)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    return folder


def test_a_projection_is_checked_against_the_event_class_and_applied(tmp_path: Path) -> None:
    good = shop_copy(tmp_path / "good", {"expose": {"payload": {"order_placed": ["order_id"]}}})
    bad = shop_copy(tmp_path / "bad", {"expose": {"payload": {"order_placed": ["price"]}}})

    shown = router("preview", "order_placed", "--target", "partners", "--json", cwd=good)
    refused = router("preview", "order_placed", cwd=bad)

    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)[0]["body"]["payload"] == {
        "order_id": "7c3fb8ef-bb1a-49f7-a3c3-00d539e5fb6e"
    }
    assert (refused.returncode, refused.stderr.strip()) == (
        2,
        "router: brokers.partners.expose.payload.order_placed: version 1 has no field "
        "'price'; its fields: order_id, customer, total",
    )


# --- a partner pinned to an older version ------------------------------------------------------

PINNED_EVENTS = """
from decimal import Decimal

from pydantic import Field

from router import Event


class OrderPlacedV1(Event, type="order_placed", version=1, published=True):
    order_id: str
    total: str


class OrderPlaced(Event, type="order_placed", version=2, published=True):
    order_id: str = Field(examples=["o-7"])
    total_cents: int = Field(examples=[4250])
    currency: str = Field(examples=["EUR"])


@OrderPlaced.downcaster(to=1)
def _to_v1(event: OrderPlaced) -> OrderPlacedV1:
    return OrderPlacedV1(order_id=event.order_id, total=f"{Decimal(event.total_cents) / 100:.2f}")
"""

STAGE = """
import asyncio

from pinned_events import OrderPlaced
from router import Outbox


async def main() -> None:
    outbox = Outbox.from_file("config.yaml")
    async with outbox.transaction() as tx:
        await tx.stage(
            OrderPlaced(order_id="o-7", total_cents=4250, currency="EUR"),
            stream_key="o-7",
            correlation_id="checkout-7",
            causation_id="cart-7",
            tenant="acme",
        )
    await outbox.close()


asyncio.run(main())
"""

# What differs from one message of an event to the next: its id and time.
PER_MESSAGE = {"id", "time"}


def pinned_shop(folder: Path, nats_streams: NatsStreams | None = None) -> dict[str, Any]:
    """A shop whose ``billing`` partner is pinned to version 1 of order_placed, its brokers on
    the test's NATS streams (made-up ones when nothing is sent); returns the streams by broker."""
    streams = {
        label: nats_streams.stream(label) if nats_streams else (label.upper(), label)
        for label in ("events", "billing")
    }
    config = {
        "service": "shop",
        "events": ["pinned_events"],
        "databases": {"main": "sqlite:///./shop.db"},
        "brokers": {
            "events": nats_broker(streams["events"], internal=True),
            "billing": nats_broker(
                streams["billing"],
                envelope="external",
                events={"include": ["*"]},
                versions={"order_placed": 1},
            ),
        },
        "http": {"enabled": False},
    }
    folder.mkdir(exist_ok=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / "pinned_events.py").write_text(PINNED_EVENTS)
    (folder / "stage.py").write_text(STAGE)
    return streams


async def test_a_pinned_partner_is_shown_the_downcast_message_it_receives(
    tmp_path: Path, nats_streams: NatsStreams
) -> None:
    streams = pinned_shop(tmp_path, nats_streams)
    metadata = ["--correlation-id", "checkout-7", "--causation-id", "cart-7", "--tenant", "acme"]
    payload = '{"order_id": "o-7", "total_cents": 4250, "currency": "EUR"}'
    shown = router(
        "preview", "order_placed", "--all-targets", "--payload", payload, "--stream-key", "o-7",
        *metadata, "--json", cwd=tmp_path,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert shown.stderr == ""  # no --version asked: nothing to note
    previews = {p["target"]: p for p in json.loads(shown.stdout)}

    assert router("init-db", cwd=tmp_path).returncode == 0
    staged = python(str(tmp_path / "stage.py"), cwd=tmp_path)
    assert staged.returncode == 0, staged.stderr
    serving = Serving(tmp_path)
    try:
        serving.wait_for("router.started")
        received = {
            target: (await nats_streams.messages(stream[0], 1))[0]
            for target, stream in streams.items()
        }
    finally:
        serving.stop()

    billing = previews["billing"]
    assert (billing["staged_version"], billing["pinned_version"]) == (2, 1)
    assert billing["headers"]["event-version"] == "1"
    assert billing["body"]["payload"] == {"order_id": "o-7", "total": "42.50"}
    assert (billing["body"]["correlation_id"], billing["body"]["causation_id"]) == (
        "checkout-7",
        "cart-7",
    )
    assert "tenant" not in billing["body"]  # internal-only: partners never get it
    assert previews["events"]["body"]["tenant"] == "acme"
    assert previews["events"]["body"]["version"] == 2
    for target, message in received.items():
        preview = previews[target]
        body = json.loads(message.data)
        # The internal envelope's sequence is the row's seq; a preview's is 1.
        same = PER_MESSAGE | {"sequence"}
        assert {k: v for k, v in body.items() if k not in same} == {
            k: v for k, v in preview["body"].items() if k not in same
        }, target
        # (Ids differ between the preview and what was staged and sent.)
        headers = {
            k: v for k, v in preview["headers"].items() if k not in ("message-id", "Nats-Msg-Id")
        }
        assert {k: message.headers[k] for k in headers} == headers, target


def test_a_version_other_than_the_pin_is_shown_downcast_with_a_note(tmp_path: Path) -> None:
    pinned_shop(tmp_path)

    newer = router("preview", "order_placed", "--target", "billing", "--version", "2", cwd=tmp_path)
    same = router("preview", "order_placed", "--target", "billing", "--version", "1", cwd=tmp_path)
    unpinned = router(
        "preview", "order_placed", "--target", "events", "--version", "1", cwd=tmp_path
    )

    assert newer.returncode == 0, newer.stderr
    assert newer.stderr.strip() == (
        "router: note: target 'billing' is pinned to 'order_placed' version 1: it receives "
        "version 2 downcast to version 1, as shown"
    )
    lines = newer.stdout.splitlines()
    assert lines[1] == "version      1, pinned (downcast from 2)"
    assert "  event-version  1" in lines
    body = json.loads(newer.stdout[newer.stdout.index("{") :])
    assert (body["version"], body["payload"]) == (1, {"order_id": "o-7", "total": "42.50"})
    assert (same.returncode, same.stderr) == (0, "")
    assert same.stdout.splitlines()[1] == "version      1, pinned"
    assert (unpinned.returncode, unpinned.stderr) == (0, "")
    assert not unpinned.stdout.splitlines()[1].startswith("version")


def test_a_downcaster_that_fails_on_the_previewed_event_is_a_one_line_error(
    tmp_path: Path,
) -> None:
    pinned_shop(tmp_path)
    events = tmp_path / "pinned_events.py"
    events.write_text(
        events.read_text().replace(
            "    return OrderPlacedV1(",
            "    raise ValueError('no v1 form')\n    return OrderPlacedV1(",
        )
    )

    result = router("preview", "order_placed", "--target", "billing", cwd=tmp_path)

    assert (result.returncode, result.stdout, result.stderr.strip()) == (
        2,
        "",
        "router: target 'billing' is pinned to 'order_placed' version 1, and version 2 cannot "
        "be downcast to it: no v1 form",
    )


# --- priority, and where each message goes -----------------------------------------------------

WAREHOUSE = {
    "type": "rabbitmq",
    "url": "amqp://shop:hunter2@rabbit.example.com:5672/wh",
    "exchange": {"name": "shop.events", "type": "topic"},
    "destination": "{event_type}",
    "expose": {"fields": ["priority"]},
}


def with_warehouse(folder: Path) -> Path:
    """The shipped example in ``folder`` with a RabbitMQ partner that may see the priority."""
    shop_copy(folder, {})
    config = yaml.safe_load((folder / "config.yaml").read_text())
    config["brokers"]["warehouse"] = WAREHOUSE
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    return folder


def test_priority_is_shown_where_the_wire_carries_it_and_each_target_names_its_exchange_or_stream(
    tmp_path: Path,
) -> None:
    folder = with_warehouse(tmp_path)

    result = router("preview", "order_placed", "--priority", "5", "--json", cwd=folder)
    text = router("preview", "order_placed", "--priority", "5", "--target", "warehouse", cwd=folder)

    assert result.returncode == 0, result.stderr
    sent = {message["target"]: message for message in json.loads(result.stdout)}
    events, partners, warehouse = sent["events"], sent["partners"], sent["warehouse"]
    # The internal envelope carries it; RabbitMQ carries it as the AMQP priority too, where
    # the partner may see it; the NATS partner, which may not, gets it nowhere.
    assert events["body"]["priority"] == 5
    assert (warehouse["body"]["priority"], warehouse["properties"]["priority"]) == (5, 5)
    assert "priority" not in partners["body"] and "priority" not in partners["properties"]
    assert events["binding"] == {"stream": "SHOP"}
    assert partners["binding"] == {"stream": "PARTNERS"}
    assert warehouse["binding"] == {
        "exchange": {"name": "shop.events", "type": "topic", "durable": True},
        "vhost": "wh",
    }
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[1:4] == [
        "destination  order_placed",
        "exchange     shop.events (topic, durable)",
        "vhost        wh",
    ]
    assert ["priority", "5"] in [line.split() for line in lines]
