"""Five brokers, one of each kind, on real peers: the harnesses and a router config for them
(tests/integration/conftest.py has the ``partners`` fixture)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from router.config import RouterConfig
from tests.conftest import make_config
from tests.contract.harnesses import Harness

__all__ = ["config_for"]


def config_for(
    url: str, harnesses: dict[str, Harness], base_dir: Path | None = None
) -> RouterConfig:
    """NATS internal (``events``), every other harness a partner; quick retries."""
    brokers: dict[str, Any] = {}
    for name, harness in harnesses.items():
        brokers[name] = harness.config(
            internal=(name == "events"), connect_timeout=2, publish_timeout=5
        )
    retry = {"base_delay": 0.2, "max_delay": 0.5, "jitter": 0.1, "max_attempts": 1000}
    return make_config({"main": url}, brokers, base_dir, outbox={"retry": retry})
