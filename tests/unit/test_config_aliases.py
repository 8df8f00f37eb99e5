"""YAML anchors and aliases in config.yaml: a few (merge keys included) work; a document whose
aliases expand it a billion-fold (a "billion laughs") is refused before anything expands it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from router import ConfigError, load_config, parse_config

# Nine lines, 28 values written, 9**9 (387 million) once every alias is expanded.
BOMB = "\n".join(
    [
        'a: &a ["x","x","x","x","x","x","x","x","x"]',
        *(
            f"{name}: &{name} [{','.join([f'*{previous}'] * 9)}]"
            for previous, name in zip("abcdefgh", "bcdefghi", strict=True)
        ),
    ]
)
REFUSED = (
    "{source}: its aliases (*name) expand it to more than 100000 values "
    "(28 written): refused, as a config never needs that many; write repeated parts out, "
    "or use fewer aliases"
)
MERGED = """
databases: {main: "sqlite:///x.db"}
brokers:
  events: &defaults {type: memory, internal: true, publish_timeout: 3}
  billing: {<<: *defaults, internal: false, destination: "billing.{event_type}"}
  audit: &audit {<<: *defaults, internal: false, events: {include: &types [orders.*, inv.*]}}
  archive: {<<: *audit, events: {include: *types, exclude: [orders.draft]}}
"""


def test_an_alias_bomb_is_refused_at_once_naming_the_file(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(BOMB)

    started = time.perf_counter()
    with pytest.raises(ConfigError) as parsed:
        parse_config(BOMB, source="bomb.yaml", env={})
    with pytest.raises(ConfigError) as loaded:
        load_config(config, env={})
    elapsed = time.perf_counter() - started

    assert str(parsed.value) == REFUSED.format(source="bomb.yaml")
    assert str(loaded.value) == REFUSED.format(source=config)
    assert elapsed < 0.2


def test_an_alias_to_itself_is_refused() -> None:
    with pytest.raises(ConfigError) as error:
        parse_config("databases: &loop {main: *loop}\n", env={})

    assert str(error.value) == (
        "config.yaml: refused: the value at line 1, column 12 contains itself (an alias "
        "*name inside its own anchor &name)"
    )


def test_anchors_aliases_and_merge_keys_still_work() -> None:
    config = parse_config(MERGED, env={})

    assert config.brokers["billing"].publish_timeout == 3
    assert config.brokers["billing"].destination == "billing.{event_type}"
    assert config.brokers["archive"].wants("inv.paid", published=True)
    assert not config.brokers["archive"].wants("orders.draft", published=True)
