"""`router status --watch` as a user runs it: frames until interrupted, then exit 0; and the
flow table under the backlog table."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from decimal import Decimal

import pytest
import yaml

from router import Outbox
from tests.conftest import Database, make_config
from tests.e2e.helpers import ROUTER
from tests.integration.events import OrderPlaced

BROKERS = {"events": {"type": "memory", "internal": True}, "partner": {"type": "memory"}}


@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
async def test_watch_redraws_until_interrupted(database: Database) -> None:
    (database.base_dir / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "service": "shop",
                "databases": {"main": database.url},
                "brokers": {**BROKERS, "partner": {"type": "memory", "rate_limit": 50}},
            }
        )
    )
    watching = subprocess.Popen(  # noqa: ASYNC220 (the test waits on it, nothing else runs)
        [str(ROUTER), "status", "--watch", "0.2"],
        cwd=database.base_dir,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(2.5)  # noqa: ASYNC251
    watching.send_signal(signal.SIGINT)
    out, err = watching.communicate(timeout=10)
    assert (watching.returncode, err) == (0, "")
    # Not a terminal: one frame after another under its time, each the backlog and the flow.
    frames = re.split(r"^# \S+\n", out, flags=re.MULTILINE)
    assert frames[0] == "" and len(frames) >= 4, out
    assert all(f.startswith("database") and "last minute" in f for f in frames[1:])
    assert "main/partner  " in frames[-1] and "rate 50/s burst 50" in frames[-1]

    once = subprocess.run(  # noqa: ASYNC221
        [str(ROUTER), "status", "--json"], cwd=database.base_dir, capture_output=True, text=True
    )
    targets = {t["target"]: t for t in json.loads(once.stdout)["targets"]}
    assert targets["partner"]["rate_limit"] == {"messages_per_second": 50, "burst": 50}
    assert (targets["partner"]["new"], targets["partner"]["time_to_empty_seconds"]) == (0, 0.0)


@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
async def test_json_output_masks_secrets_as_the_tables_do(database: Database) -> None:
    """An error text may quote a URL with its password: `--json` masks it as tables do."""
    secret = "s3cret-partner-pw"
    partner = {"type": "redis", "url": f"redis://user:{secret}@127.0.0.1:1/0"}
    brokers = {**BROKERS, "partner": partner}
    (database.base_dir / "config.yaml").write_text(
        yaml.safe_dump({"service": "shop", "databases": {"main": database.url}, "brokers": brokers})
    )
    outbox = Outbox(make_config({"main": database.url}, brokers, database.base_dir))
    async with outbox.transaction() as tx:
        await tx.stage(OrderPlaced(order_id="o-1", total=Decimal(1)))
    await outbox.close()
    await database.execute(
        "UPDATE router_outbox SET status = 'abandoned', last_attempt_at = created_at,"
        f" last_error = 'cannot connect to redis://user:{secret}@127.0.0.1:1/0'"
        " WHERE target = 'partner'"
    )
    for command in (["status", "--json"], ["status"], ["groups", "--json"], ["groups"]):
        shown = subprocess.run(  # noqa: ASYNC221
            [str(ROUTER), *command], cwd=database.base_dir, capture_output=True, text=True
        )
        assert shown.returncode == 0, shown
        assert secret not in shown.stdout, (command, shown.stdout)
        # The raw error is shown masked; the groups table shows its normalised message.
        assert "***" in shown.stdout or command == ["groups"], (command, shown.stdout)
