"""examples/fastapi_shop as its docs page (docs/frameworks-fastapi.md) and README run it,
against PostgreSQL and NATS JetStream: the documented ``router init-db`` and ``python -m
fastapi_shop.app create-tables``, then ``router serve`` beside the app. The app is driven
in-process with FastAPI's ``TestClient`` (in place of uvicorn; its lifespan and every request
on one event loop), request after request on one engine's pool."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.pool import AsyncAdaptedQueuePool

from fastapi_shop.app import Shop, create_app
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

DOCS = ROOT / "docs" / "frameworks-fastapi.md"
EXAMPLE = ROOT / "examples" / "fastapi_shop"


def test_the_docs_page_and_the_readme_document_the_commands_run_here() -> None:
    commands = documented_commands(DOCS)
    assert documented_commands(EXAMPLE / "README.md") == commands
    assert commands.exported == {"ROUTER_CONFIG", "DATABASE_URL", "NATS_URL"}  # set by `env`
    assert commands.lines == [
        "router init-db",  # the `serving` fixture runs these two as they are written
        "python -m fastapi_shop.app create-tables",
        "router serve &",  # then serves
        "uvicorn fastapi_shop.app:app",  # the TestClient, in process
    ]
    assert lines_not_in(DOCS, EXAMPLE / "app.py") == []


@pytest.fixture
async def env(
    pg_databases: PgDatabases, nats_streams: NatsStreams, monkeypatch: pytest.MonkeyPatch
) -> dict[str, str]:
    """The README's environment, on a fresh database and a stream of this test's own."""
    return await example_env("fastapi_shop", pg_databases, nats_streams, monkeypatch)


@pytest.fixture
def serving(env: dict[str, str], tmp_path: Path) -> Iterator[Serving]:
    """The documented ``router init-db`` and ``create-tables``, then ``router serve``,
    stopped (exit code 0) after the test."""
    for line in documented_commands(DOCS).lines[:2]:
        done = run_documented(line)
        assert done.returncode == 0, f"{line}\n{done.stdout}{done.stderr}"
    serve = Serving(tmp_path)
    serve.wait_for("router.started")
    yield serve
    assert serve.stop() == 0, serve.log.read_text()


def place(client: TestClient, customer: str, total: str, **extra: object) -> str:
    response = client.post("/orders", json={"customer": customer, "total": total, **extra})
    assert response.status_code == 201, response.text
    order_id: str = response.json()["id"]
    return order_id


def test_placed_and_paid_orders_reach_nats_and_a_failed_one_does_not(
    serving: Serving, env: dict[str, str], nats_streams: NatsStreams
) -> None:
    app = create_app()
    with TestClient(app) as client:
        orders = [place(client, f"customer-{i}", f"{19 + i}.90") for i in range(3)]
        failed = client.post(
            "/orders", json={"customer": "mallory", "total": "1.00", "fail_after_stage": True}
        )
        assert failed.status_code == 500
        assert "failed after staging" in failed.json()["error"]
        for order_id in orders[:2]:
            paid = client.post(f"/orders/{order_id}/pay")
            assert paid.status_code == 200, paid.text
            assert paid.json() == {"id": order_id, "status": "paid"}
        assert client.post(f"/orders/{orders[0]}/pay").status_code == 409  # stages nothing
        assert client.post(f"/orders/{uuid.uuid4()}/pay").status_code == 404
        # Every request ran on the one connection of the engine's default pool.
        shop: Shop = app.state.shop
        pool = shop.outbox.engine().pool
        assert isinstance(pool, AsyncAdaptedQueuePool)  # SQLAlchemy's default
        assert (pool.checkedin(), pool.checkedout()) == (1, 0)

    messages = delivered(nats_streams, env, 5)
    check_envelopes(messages, env, "fastapi-shop")
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
