"""The Grafana dashboard and alert rules shipped in docs/grafana/ query only metrics `router
serve` exports: every `router_*` name in their queries has samples in a real /metrics scrape (a router on
PostgreSQL and NATS with a rate-limited internal broker and a partner that is down, so every
counter, histogram and gauge has something to say)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import yaml

from router import Outbox
from tests.conftest import NatsStreams, make_config, nats_broker
from tests.e2e.helpers import ROOT, Serving
from tests.integration.events import OrderPlaced
from tests.services import free_port

DASHBOARD = ROOT / "docs" / "grafana" / "outbox-router.json"
ALERT_RULES = ROOT / "docs" / "grafana" / "alert-rules.yaml"
TOKEN = "grafana-test-token"


def queried_metrics(dashboard: dict[str, Any]) -> set[str]:
    """Every metric name in the panels' queries and the template variables."""
    texts = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    texts += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return set(re.findall(r"\brouter_[a-z_]+", " ".join(texts)))


def alerted_metrics(rules: dict[str, Any]) -> set[str]:
    """Every metric name in the alert rules' Prometheus queries."""
    texts = [
        query["model"]["expr"]
        for group in rules["groups"]
        for rule in group["rules"]
        for query in rule["data"]
        if "expr" in query["model"]
    ]
    return set(re.findall(r"\brouter_[a-z_]+", " ".join(texts)))


def test_the_alert_rules_are_grafana_provisioning_rules() -> None:
    rules = yaml.safe_load(ALERT_RULES.read_text())
    assert rules["apiVersion"] == 1
    (group,) = rules["groups"]
    for rule in group["rules"]:
        assert rule["uid"] and rule["title"] and rule["for"]
        refs = {query["refId"] for query in rule["data"]}
        assert rule["condition"] in refs
    assert "router_held_keys" in alerted_metrics(rules)


def test_the_dashboard_is_a_grafana_dashboard() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "outbox-router" and dashboard["panels"]
    for panel in dashboard["panels"]:
        assert panel["title"] and panel["targets"] and set(panel["gridPos"]) == {"x", "y", "w", "h"}
        assert all(t["expr"] and t["refId"] for t in panel["targets"])
    assert {v["name"] for v in dashboard["templating"]["list"]} == {
        "datasource",
        "database",
        "target",
    }


async def test_every_metric_the_dashboard_queries_is_exported(
    pg_url: str, nats_streams: NatsStreams, tmp_path: Path
) -> None:
    port = free_port()
    internal, partner = nats_streams.stream("int"), nats_streams.stream("ext")
    brokers: dict[str, Any] = {
        "events": {
            **nats_broker(internal, internal=True),
            "rate_limit": {"messages_per_second": 20, "burst": 2},
        },
        "partner": {
            **nats_broker(partner, url=f"nats://127.0.0.1:{free_port()}", connect_timeout=0.5),
            "on_backlog": {"max_rows": 100, "action": "alert"},
        },
    }
    (tmp_path / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "service": "shop",
                "databases": {"main": pg_url},
                "brokers": brokers,
                "outbox": {"retry": {"base_delay": 60, "max_delay": 60, "max_attempts": 1}},
                "http": {"bind": f"127.0.0.1:{port}", "token": TOKEN},
            }
        )
    )
    outbox = Outbox(make_config({"main": pg_url}, brokers))
    async with outbox.transaction() as tx:
        await tx.stage(*(OrderPlaced(order_id=f"o-{i}", total=Decimal(i)) for i in range(10)))
    await outbox.close()
    serving = Serving(tmp_path)
    try:
        await asyncio.to_thread(serving.wait_for, "router.started")
        metrics = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
                answer = await client.get(
                    f"http://127.0.0.1:{port}/metrics",
                    headers={"Authorization": f"Bearer {TOKEN}"},
                )
            metrics = answer.text
            if 'router_published_total{database="main",target="events"} 10.0' in metrics:
                break
            await asyncio.sleep(0.2)
    finally:
        serving.stop()
    sampled = {line.split("{")[0].split(" ")[0] for line in metrics.splitlines() if line[:1] != "#"}
    wanted = queried_metrics(json.loads(DASHBOARD.read_text()))
    wanted |= alerted_metrics(yaml.safe_load(ALERT_RULES.read_text()))
    assert len(wanted) >= 15
    missing = sorted(name for name in wanted if name not in sampled)
    assert not missing, f"queried by the dashboard, not in /metrics: {missing}"
