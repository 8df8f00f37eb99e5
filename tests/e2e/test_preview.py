"""``router preview`` on the shipped config: what each target would receive, sent nowhere."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import yaml

from envelopes import INTERNAL_ONLY_FIELDS
from tests.e2e.helpers import ROOT, router


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
