"""``router contract``: the partner contract exported as AsyncAPI 3.0 (valid against the
official schema, and describing what ``router preview`` shows a partner gets), locked, and
checked after the example's events change."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from referencing import Registry
from referencing.jsonschema import DRAFT7

from tests.e2e.helpers import ROOT, router

ASYNCAPI_SCHEMA = ROOT / "tests" / "schemas" / "asyncapi-3.0.0.json"
MESSAGE = "partners.order_placed.v1"  # the shipped partner's one message
KAFKA_PARTNER = """
  analytics:
    type: kafka
    bootstrap_servers: "analytics.example.com:9093"
    sasl: {mechanism: PLAIN, username: shop, password: "${KAFKA_PASSWORD:-hunter2}"}
    envelope: cloudevents
    cloudevents_mode: binary
    destination: "shop.{event_type}.v{version}"
    expose: {headers: ["x-tenant", "x-trace-*"], extensions: [region]}
"""


def assert_valid_asyncapi(document: dict[str, Any]) -> None:
    schema = json.loads(ASYNCAPI_SCHEMA.read_text())
    validator = jsonschema.Draft7Validator(schema)
    error = jsonschema.exceptions.best_match(validator.iter_errors(document))
    assert error is None, f"{error.json_path}: {error.message}"


def part_of(document: dict[str, Any], pointer: str) -> jsonschema.Draft7Validator:
    """A validator for the schema at ``pointer`` in the document (its $refs resolved there)."""
    registry: Registry[Any] = Registry().with_resource(
        "urn:contract", DRAFT7.create_resource(document)
    )
    return jsonschema.Draft7Validator({"$ref": f"urn:contract#{pointer}"}, registry=registry)


def shop(folder: Path, partner: str = "", events: str | None = None) -> Path:
    """A copy of the shipped example in ``folder``: its events as module shop_events (edited
    by ``events``, a function of the text, when given), its config with ``partner`` lines
    added to the partners broker."""
    text = (ROOT / "examples" / "shop" / "events.py").read_text()
    (folder / "shop_events.py").write_text(text if events is None else events)
    config = (ROOT / "config.yaml").read_text()
    for old, new in (
        ("events: [examples.shop.events]", "events: [shop_events]"),
        ("    envelope: external\n", f"    envelope: external\n{partner}"),
    ):
        assert old in config
        config = config.replace(old, new)
    (folder / "config.yaml").write_text(config)
    return folder


def exported(cwd: Path, *args: str) -> dict[str, Any]:
    result = router("contract", "export", *args, cwd=cwd)
    assert result.returncode == 0, result.stderr
    document: dict[str, Any] = json.loads(result.stdout)
    return document


def test_the_shipped_example_exports_a_valid_asyncapi_document_of_its_partner() -> None:
    document = exported(ROOT)

    assert_valid_asyncapi(document)
    assert document["asyncapi"] == "3.0.0"
    assert document["info"]["title"] == "shop"
    # The internal broker ("events") is not a partner contract.
    assert list(document["servers"]) == ["partners"]
    assert document["servers"]["partners"]["protocol"] == "nats"
    [channel] = document["channels"].values()
    assert channel["address"] == "partners.order_placed"
    assert list(channel["messages"]) == ["order_placed.v1"]
    [operation] = document["operations"].values()
    assert operation["action"] == "send"
    message = document["components"]["messages"][MESSAGE]
    assert message["payload"]["properties"]["payload"]["required"] == [
        "order_id",
        "customer",
        "total",
    ]
    assert not {"tenant", "checksum", "event_class", "headers", "extensions"} & set(
        message["payload"]["properties"]
    )


def test_what_preview_shows_the_partner_is_what_the_exported_message_describes() -> None:
    document = exported(ROOT)
    preview = router(
        "preview",
        "order_placed",
        "--target",
        "partners",
        "--stream-key",
        "o-1",
        "--skipped",  # after a gap: the header the contract declares is sent too
        "01a20935-b120-70ec-a2ef-2ad62ecc67f0",
        "--json",
        cwd=ROOT,
    )
    assert preview.returncode == 0, preview.stderr
    [sent] = json.loads(preview.stdout)
    assert sent["headers"]["skipped-message-ids"] == "01a20935-b120-70ec-a2ef-2ad62ecc67f0"

    pointer = f"/components/messages/{MESSAGE}"
    part_of(document, f"{pointer}/payload").validate(sent["body"])
    # preview lists every header on the wire, the one the NATS adapter adds included
    # (NatsSettings.native_headers), and the contract declares them all.
    assert sent["headers"]["Nats-Msg-Id"] == sent["headers"]["message-id"]
    part_of(document, f"{pointer}/headers").validate(sent["headers"])
    # And the contract is strict enough to refuse what the partner does not get.
    broken = {**sent["body"], "payload": {**sent["body"]["payload"], "total": 42.5}}
    assert not part_of(document, f"{pointer}/payload").is_valid(broken)


def test_a_cloudevents_partner_on_kafka_is_exported_with_its_attribute_headers(
    tmp_path: Path,
) -> None:
    folder = shop(tmp_path)
    config = folder / "config.yaml"
    config.write_text(config.read_text().replace("\noutbox:", f"{KAFKA_PARTNER}\noutbox:", 1))

    result = router("contract", "export", "--out", "asyncapi.yaml", cwd=folder)
    assert result.returncode == 0, result.stderr
    assert (
        result.stdout == "asyncapi.yaml: AsyncAPI 3.0.0, 2 partner(s), 2 channel(s), 2 message(s)\n"
    )
    document = yaml.safe_load((folder / "asyncapi.yaml").read_text())

    assert_valid_asyncapi(document)
    assert document == exported(folder)
    server = document["servers"]["analytics"]
    # The host comes from the redacted address: never a credential.
    assert (server["host"], server["protocol"]) == ("analytics.example.com:9093", "kafka")
    assert "hunter2" not in (folder / "asyncapi.yaml").read_text()
    message = document["components"]["messages"]["analytics.order_placed.v1"]
    assert document["channels"]["analytics.shop.order_placed.v1"]["address"] == (
        "shop.order_placed.v1"
    )
    headers = message["headers"]
    assert {"ce_id", "ce_source", "ce_type", "ce_specversion", "message-id"} <= set(
        headers["required"]
    )
    assert headers["properties"]["ce_type"]["const"] == "order_placed"
    assert set(headers["patternProperties"]) == {
        "^[xX]-[tT][eE][nN][aA][nN][tT]$",
        "^[xX]-[tT][rR][aA][cC][eE]-.*$",
        "^[cC][eE]_[rR][eE][gG][iI][oO][nN]$",
    }
    # Binary mode: the body is the data alone.
    assert message["payload"]["title"] == "OrderPlaced"


def test_a_payload_projection_hides_a_field_from_the_exported_schema(tmp_path: Path) -> None:
    folder = shop(tmp_path, "    expose: {payload: {order_placed: [order_id, total]}}\n")

    document = exported(folder)

    assert_valid_asyncapi(document)
    payload = document["components"]["messages"][MESSAGE]["payload"]["properties"]["payload"]
    assert list(payload["properties"]) == ["order_id", "total"]
    assert payload["required"] == ["order_id", "total"]


def test_lock_then_check_passes(tmp_path: Path) -> None:
    folder = shop(tmp_path)

    locked = router("contract", "lock", cwd=folder)
    checked = router("contract", "check", cwd=folder)

    assert (locked.returncode, locked.stdout) == (
        0,
        "contracts.lock.json: written, 1 event version(s) for 1 partner(s)\n",
    )
    lock = json.loads((folder / "contracts.lock.json").read_text())
    entry = lock["partners"]["partners"]["events"]["order_placed"]["1"]
    assert entry["destination"] == "partners.order_placed"
    assert "events" not in lock["partners"]
    assert (checked.returncode, checked.stdout) == (
        0,
        "contract check: the code matches contracts.lock.json\n",
    )


def test_renaming_a_field_of_a_published_event_fails_the_check(tmp_path: Path) -> None:
    folder = shop(tmp_path)
    assert router("contract", "lock", cwd=folder).returncode == 0
    events = (folder / "shop_events.py").read_text()
    (folder / "shop_events.py").write_text(events.replace("    customer: str", "    buyer: str"))

    result = router("contract", "check", cwd=folder)
    as_json = router("contract", "check", "--json", cwd=folder)

    assert result.returncode == 1, result.stderr
    assert (
        "breaking  partners  order_placed v1  payload.customer: renamed to payload.buyer "
        "(removed, and added with its schema)"
    ) in result.stdout.splitlines()
    assert as_json.returncode == 1
    [change] = json.loads(as_json.stdout)["changes"]
    assert change == {
        "breaking": True,
        "partner": "partners",
        "event_type": "order_placed",
        "version": 1,
        "field": "payload.customer",
        "change": "renamed to payload.buyer (removed, and added with its schema)",
    }


def test_a_new_optional_field_passes_the_check_and_is_listed(tmp_path: Path) -> None:
    folder = shop(tmp_path)
    assert router("contract", "lock", cwd=folder).returncode == 0
    events = (folder / "shop_events.py").read_text()
    (folder / "shop_events.py").write_text(
        events.replace("    total: Decimal", "    coupon: str | None = None\n    total: Decimal")
    )

    result = router("contract", "check", cwd=folder)

    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        "contract check against contracts.lock.json: 0 breaking, 1 additive change(s)",
        "additive  partners  order_placed v1  payload.coupon: new optional field",
        "No breaking change: run `router contract lock` to record these.",
    ]


def test_a_new_required_field_fails_the_check_with_one_line(tmp_path: Path) -> None:
    folder = shop(tmp_path)
    assert router("contract", "lock", cwd=folder).returncode == 0
    events = (folder / "shop_events.py").read_text()
    (folder / "shop_events.py").write_text(
        events.replace("    total: Decimal", "    coupon: str\n    total: Decimal")
    )

    result = router("contract", "check", cwd=folder)

    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.splitlines()[:2] == [
        "contract check against contracts.lock.json: 1 breaking, 0 additive change(s)",
        "breaking  partners  order_placed v1  payload.coupon: new required field: messages "
        "already sent at this version lack it (make it optional, or add it in a new version)",
    ]


def test_check_without_a_lock_says_how_to_make_one(tmp_path: Path) -> None:
    folder = shop(tmp_path)

    result = router("contract", "check", "--file", "elsewhere.json", cwd=folder)

    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        "router: no contract lock at elsewhere.json; run `router contract lock`\n"
    )


def test_contract_help_says_internal_brokers_are_not_in_it() -> None:
    result = router("contract", "--help", cwd=ROOT)

    assert result.returncode == 0
    assert "Internal brokers are not in it" in " ".join(result.stdout.split())


RABBIT_PARTNER = """
  warehouse:
    type: rabbitmq
    url: "amqp://shop:${RABBIT_PASSWORD:-hunter2}@rabbit.example.com:5672/wh"
    exchange: {name: shop.events, type: topic}
    destination: "{event_type}"
"""
SERVICEBUS_PARTNER = """
  billing:
    type: servicebus
    connection_string: "Endpoint=sb://bus.example.com/;SharedAccessKeyName=k;SharedAccessKey=s"
    entity: topic
    destination: shop-events
  audit:
    type: redis
    url: "redis://127.0.0.1:6379/3"
    destination: "shop:{event_type}"
"""


def with_partners(folder: Path, partners: str) -> Path:
    config = folder / "config.yaml"
    config.write_text(config.read_text().replace("\noutbox:", f"{partners}\noutbox:", 1))
    return folder


def test_each_channel_says_where_a_partner_consumes_it(tmp_path: Path) -> None:
    folder = with_partners(shop(tmp_path), KAFKA_PARTNER + RABBIT_PARTNER + SERVICEBUS_PARTNER)

    document = exported(folder)

    assert_valid_asyncapi(document)
    channels, messages = document["channels"], document["components"]["messages"]
    # RabbitMQ: the exchange the partner binds its queue to, with the routing key as address.
    warehouse = channels["warehouse.order_placed"]
    assert warehouse["address"] == "order_placed"
    assert warehouse["bindings"]["amqp"] == {
        "is": "routingKey",
        "exchange": {
            "name": "shop.events",
            "type": "topic",
            "durable": True,
            "autoDelete": False,
            "vhost": "wh",
        },
        "bindingVersion": "0.3.0",
    }
    [operation] = [o for o in document["operations"].values() if "amqp" in o.get("bindings", {})]
    assert operation["bindings"]["amqp"] == {
        "deliveryMode": 2,
        "mandatory": True,
        "bindingVersion": "0.3.0",
    }
    assert messages["warehouse.order_placed.v1"]["bindings"]["amqp"]["messageType"] == (
        "order_placed"
    )
    # Kafka: the topic, and the record key (the stream key).
    analytics = channels["analytics.shop.order_placed.v1"]
    assert analytics["bindings"]["kafka"] == {
        "topic": "shop.order_placed.v1",
        "bindingVersion": "0.5.0",
    }
    key = messages["analytics.order_placed.v1"]["bindings"]["kafka"]["key"]
    assert key["type"] == "string"
    # NATS: the JetStream stream (the nats binding has no channel fields).
    assert channels["partners.partners.order_placed"]["x-jetstream"] == {
        "stream": "PARTNERS",
        "subject": "partners.order_placed",
    }
    # Service Bus and Redis have no binding of their own in AsyncAPI.
    assert channels["billing.shop-events"]["x-servicebus"] == {
        "entity": "topic",
        "sessions": False,
        "name": "shop-events",
    }
    assert channels["audit.shop_order_placed"]["x-redis"] == {
        "stream": "shop:order_placed",
        "db": 3,
    }
    assert "hunter2" not in json.dumps(document)


def test_renaming_the_stream_a_partner_consumes_fails_the_check(tmp_path: Path) -> None:
    folder = shop(tmp_path)
    assert router("contract", "lock", cwd=folder).returncode == 0
    config = folder / "config.yaml"
    config.write_text(config.read_text().replace("name: PARTNERS", "name: PARTNERS_V2"))

    result = router("contract", "check", cwd=folder)

    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.splitlines()[:2] == [
        "contract check against contracts.lock.json: 1 breaking, 0 additive change(s)",
        "breaking  partners  every event  binding.stream: changed: PARTNERS -> PARTNERS_V2; "
        "a partner bound to the old one receives nothing more",
    ]


def test_renaming_or_retyping_the_exchange_fails_the_check(tmp_path: Path) -> None:
    folder = with_partners(shop(tmp_path), RABBIT_PARTNER)
    assert router("contract", "lock", cwd=folder).returncode == 0
    config = folder / "config.yaml"
    config.write_text(
        config.read_text().replace(
            "{name: shop.events, type: topic}", "{name: shop.orders, type: fanout}"
        )
    )

    result = router("contract", "check", "--json", cwd=folder)

    assert result.returncode == 1, result.stdout + result.stderr
    changes = json.loads(result.stdout)["changes"]
    assert [(c["partner"], c["field"], c["change"]) for c in changes] == [
        (
            "warehouse",
            "binding.exchange.name",
            "changed: shop.events -> shop.orders; a partner bound to the old one receives "
            "nothing more",
        ),
        (
            "warehouse",
            "binding.exchange.type",
            "changed: topic -> fanout; a partner bound to the old one receives nothing more",
        ),
    ]


def test_turning_off_persistent_or_mandatory_fails_the_check(tmp_path: Path) -> None:
    folder = with_partners(shop(tmp_path), RABBIT_PARTNER)
    assert router("contract", "lock", cwd=folder).returncode == 0
    config = folder / "config.yaml"
    text = config.read_text()
    exchange = "    exchange: {name: shop.events, type: topic}\n"
    config.write_text(text.replace(exchange, exchange + "    persistent: false\n"))

    transient = router("contract", "check", cwd=folder)
    config.write_text(text.replace(exchange, exchange + "    mandatory: false\n"))
    unchecked = router("contract", "check", cwd=folder)

    assert transient.returncode == 1, transient.stdout + transient.stderr
    assert transient.stdout.splitlines()[:2] == [
        "contract check against contracts.lock.json: 1 breaking, 0 additive change(s)",
        "breaking  warehouse  every event  binding.persistent: changed: True -> False; "
        "messages are no longer stored on disk: a broker restart loses those not yet consumed",
    ]
    assert unchecked.returncode == 1, unchecked.stdout + unchecked.stderr
    assert unchecked.stdout.splitlines()[1] == (
        "breaking  warehouse  every event  binding.mandatory: changed: True -> False; a "
        "message no queue is bound to is now dropped silently, not refused and retried"
    )


def test_an_unwritable_out_or_lock_file_is_one_line(tmp_path: Path) -> None:
    folder = shop(tmp_path)
    (folder / "adir").mkdir()

    missing = router("contract", "export", "--out", "nowhere/asyncapi.yaml", cwd=folder)
    onto_dir = router("contract", "export", "--out", "adir", cwd=folder)
    lock_missing = router("contract", "lock", "--file", "nowhere/lock.json", cwd=folder)
    check_dir = router("contract", "check", "--file", "adir", cwd=folder)

    assert (missing.returncode, missing.stdout, missing.stderr) == (
        2,
        "",
        "router: cannot write nowhere/asyncapi.yaml: its folder nowhere does not exist\n",
    )
    assert (onto_dir.returncode, onto_dir.stderr) == (
        2,
        "router: cannot write adir: it is a directory\n",
    )
    assert (lock_missing.returncode, lock_missing.stderr) == (
        2,
        "router: cannot write nowhere/lock.json: its folder nowhere does not exist\n",
    )
    assert (check_dir.returncode, check_dir.stderr) == (
        2,
        "router: cannot read adir: it is a directory\n",
    )


def test_preview_shows_the_properties_the_contract_declares(tmp_path: Path) -> None:
    folder = with_partners(shop(tmp_path), RABBIT_PARTNER)
    result = router(
        "preview",
        "order_placed",
        "--target",
        "warehouse",
        "--correlation-id",
        "c-1",
        "--json",
        cwd=folder,
    )

    assert result.returncode == 0, result.stderr
    [sent] = json.loads(result.stdout)
    properties = sent["properties"]
    assert properties["message_id"] == sent["body"]["id"]
    assert (properties["type"], properties["correlation_id"]) == ("order_placed", "c-1")
    assert "app_id" not in properties  # nothing names the library
    messages = exported(folder)["components"]["messages"]
    [message] = [m for key, m in messages.items() if "warehouse" in key]
    assert set(properties) <= set(message["x-properties"]["properties"])
    text = router("preview", "order_placed", "--target", "warehouse", cwd=folder).stdout
    assert "\nproperties\n" in text and "timestamp" in text
