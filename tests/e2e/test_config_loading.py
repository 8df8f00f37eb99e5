"""How ``router check`` loads a config a user wrote: an alias bomb is refused at once, and
the partners' secrets an ``Outbox`` loads without are required."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.e2e.helpers import ROUTER, router
from tests.unit.test_config_aliases import BOMB, REFUSED
from tests.unit.test_staging_secrets import CONFIG as STAGING_CONFIG
from tests.unit.test_staging_secrets import UNSET


def test_router_check_refuses_an_alias_bomb_at_once(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(BOMB)

    result = router("check", cwd=tmp_path, timeout=10)

    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"router: {REFUSED.format(source='config.yaml')}\n"


def test_router_check_refuses_the_secrets_an_outbox_loads_without(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(STAGING_CONFIG)
    unset = {line.rpartition("variable ")[2].split()[0]: "" for line in UNSET}
    environment = {k: v for k, v in os.environ.items() if k not in unset}

    result = subprocess.run(
        [str(ROUTER), "check"],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )

    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == "router: config.yaml: 4 problems:\n" + "".join(
        f"  - {line}\n" for line in UNSET
    )
