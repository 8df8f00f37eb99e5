"""How ``router check`` loads a config a user wrote: an alias bomb is refused at once."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.helpers import router
from tests.unit.test_config_aliases import BOMB, REFUSED


def test_router_check_refuses_an_alias_bomb_at_once(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(BOMB)

    result = router("check", cwd=tmp_path, timeout=10)

    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"router: {REFUSED.format(source='config.yaml')}\n"
