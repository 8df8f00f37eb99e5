"""examples/flask_shop as its docs page (docs/frameworks-flask.md) and README run it, against
PostgreSQL and NATS JetStream: the documented ``router init-db`` and ``flask ... create-tables``,
then ``router serve`` beside the app. The app is driven in-process with Flask's test client
(in place of ``flask run``), request after request on one engine's pool."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import text
from sqlalchemy.pool import NullPool, QueuePool

from flask_shop.app import Shop, create_app
from flask_shop.events import OrderPlaced
from router import Outbox, StagingError
from tests.conftest import NatsStreams, PgDatabases
from tests.e2e.example_apps import (
    check_envelopes,
    delivered,
    documented_commands,
    example_env,
    in_order_per_order,
    lines_not_in,
    query,
    run_documented,
)
from tests.e2e.helpers import ROOT, Serving

pytestmark = pytest.mark.timeout(120)

DOCS = ROOT / "docs" / "frameworks-flask.md"
EXAMPLE = ROOT / "examples" / "flask_shop"


def test_the_docs_page_and_the_readme_document_the_commands_run_here() -> None:
    commands = documented_commands(DOCS)
    assert documented_commands(EXAMPLE / "README.md") == commands
    assert commands.exported == {"ROUTER_CONFIG", "DATABASE_URL", "NATS_URL"}  # set by `env`
    assert commands.lines == [
        "router init-db",  # the `app` fixture runs these two as they are written
        "flask --app flask_shop.app create-tables",
        "router serve &",  # `serving`
        "flask --app flask_shop.app run",  # the test client, in process
    ]
    assert lines_not_in(DOCS, EXAMPLE / "app.py") == []


@pytest.fixture
async def env(
    pg_databases: PgDatabases, nats_streams: NatsStreams, monkeypatch: pytest.MonkeyPatch
) -> dict[str, str]:
    """The README's environment, on a fresh database and a stream of this test's own."""
    return await example_env("flask_shop", pg_databases, nats_streams, monkeypatch)


@pytest.fixture
def app(env: dict[str, str]) -> Iterator[Flask]:
    """The example app after the documented ``router init-db`` and ``create-tables``."""
    commands = documented_commands(DOCS)
    for line in commands.lines[:2]:
        done = run_documented(line)
        assert done.returncode == 0, f"{line}\n{done.stdout}{done.stderr}"
    app = create_app()
    app.config["TESTING"] = True  # an unhandled error reaches the test as itself
    yield app
    app.extensions["shop"].engine.dispose()


@pytest.fixture
def serving(app: Flask, tmp_path: Path) -> Iterator[Serving]:
    """``router serve`` with the example's config, stopped (exit code 0) after the test."""
    serve = Serving(tmp_path)
    serve.wait_for("router.started")
    yield serve
    assert serve.stop() == 0, serve.log.read_text()


def place(client: FlaskClient, customer: str, total: str, **extra: object) -> str:
    response = client.post("/orders", json={"customer": customer, "total": total, **extra})
    assert response.status_code == 201, response.text
    order_id: str = response.get_json()["id"]
    return order_id


def test_placed_and_paid_orders_reach_nats_and_a_failed_one_does_not(
    app: Flask, serving: Serving, env: dict[str, str], nats_streams: NatsStreams
) -> None:
    client = app.test_client()
    orders = [place(client, f"customer-{i}", f"{19 + i}.90") for i in range(3)]
    failed = client.post(
        "/orders", json={"customer": "mallory", "total": "1.00", "fail_after_stage": True}
    )
    assert failed.status_code == 500
    assert "failed after staging" in failed.get_json()["error"]
    for order_id in orders[:2]:
        paid = client.post(f"/orders/{order_id}/pay")
        assert paid.status_code == 200, paid.text
    assert client.post(f"/orders/{orders[0]}/pay").status_code == 409  # stages nothing
    assert client.post(f"/orders/{uuid.uuid4()}/pay").status_code == 404

    messages = delivered(nats_streams, env, 5)
    check_envelopes(messages, env, "flask-shop")
    assert sorted(m.event for m in messages) == sorted(
        [("order_placed", o) for o in orders] + [("order_paid", o) for o in orders[:2]]
    )
    for order_id in orders[:2]:
        assert in_order_per_order(messages, order_id) == ["order_placed", "order_paid"]
    placed = {m.event[1]: m.body["payload"] for m in messages if m.event[0] == "order_placed"}
    assert placed[orders[1]] == {"order_id": orders[1], "customer": "customer-1", "total": "20.90"}

    # The failed request's order row and outbox row rolled back together: nothing can follow.
    assert sorted(query(env, "SELECT id, status FROM orders")) == sorted(
        [(orders[0], "paid"), (orders[1], "paid"), (orders[2], "placed")]
    )
    assert query(env, "SELECT status, count(*) FROM router_outbox GROUP BY status") == [
        ("published", 5)
    ]
    assert len(delivered(nats_streams, env, 6, timeout=1)) == 5
    # Every request ran on the one connection of the app's default pool.
    shop: Shop = app.extensions["shop"]
    assert isinstance(shop.engine.pool, QueuePool)  # SQLAlchemy's default
    assert (shop.engine.pool.checkedin(), shop.engine.pool.checkedout()) == (1, 0)


def async_app(outbox: Outbox) -> Flask:
    """A Flask app whose ``async def`` view stages with the async ``Outbox``'s unit of work.

    Flask runs an async view by asgiref's ``async_to_sync``: a new event loop per request.
    """
    app = Flask(__name__)
    app.config["TESTING"] = True

    @app.post("/orders")
    async def place_order() -> tuple[dict[str, str], int]:
        order_id = str(uuid.uuid4())
        async with outbox.transaction() as tx:
            await tx.connection.execute(
                text("INSERT INTO orders (id, customer, total, status) VALUES (:i, :c, 5, 'x')"),
                {"i": order_id, "c": "ada"},
            )
            await tx.stage(
                OrderPlaced(order_id=order_id, customer="ada", total=Decimal(5)),
                stream_key=order_id,
            )
        return {"id": order_id}, 201

    return app


def test_an_async_view_on_the_pooled_async_outbox_is_refused_with_what_to_do(
    app: Flask, serving: Serving, env: dict[str, str], nats_streams: NatsStreams
) -> None:
    # Flask runs each async view in a new event loop; the Outbox's pooled engine belongs to
    # the first. The second request is refused before it touches the database, saying what
    # to do, instead of failing inside the driver with "attached to a different loop".
    outbox = Outbox.from_file(env["ROUTER_CONFIG"])
    client = async_app(outbox).test_client()
    first = client.post("/orders").get_json()["id"]
    with pytest.raises(StagingError) as refused:
        client.post("/orders")
    assert "was made on another event loop" in str(refused.value)
    assert "SyncOutbox" in str(refused.value)
    assert "outbox.engine(poolclass=sqlalchemy.pool.NullPool)" in str(refused.value)
    messages = delivered(nats_streams, env, 1)
    assert [m.event for m in messages] == [("order_placed", first)]


def test_an_async_view_on_an_unpooled_async_outbox_stages_in_every_request(
    app: Flask, serving: Serving, env: dict[str, str], nats_streams: NatsStreams
) -> None:
    outbox = Outbox.from_file(env["ROUTER_CONFIG"])
    outbox.engine(poolclass=NullPool)  # once, before the first request: what the error says
    client = async_app(outbox).test_client()
    orders = [client.post("/orders").get_json()["id"] for _ in range(3)]
    messages = delivered(nats_streams, env, 3)
    assert sorted(m.event for m in messages) == sorted(("order_placed", o) for o in orders)
