"""``Outbox.engine()``: one engine per database, its options fixed by the first call, and a
pooled engine refused on an event loop other than its own (Flask's async views run each
request in a new loop; asyncpg's pooled connections would fail there with "attached to a
different loop")."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import NullPool

from router import Outbox, StagingError
from tests.conftest import MEMORY_BROKERS, make_config


def outbox(tmp_path: Path) -> Outbox:
    return Outbox(make_config({"main": "sqlite:///outbox.db"}, MEMORY_BROKERS, base_dir=tmp_path))


def test_later_calls_return_the_engine_and_refuse_other_options(tmp_path: Path) -> None:
    made = outbox(tmp_path)
    engine = made.engine(echo=False)
    assert made.engine() is engine
    assert made.engine(echo=False) is engine
    with pytest.raises(ValueError, match=r"exists already, made with \['echo'\]"):
        made.engine(echo=True)


async def engine_here(made: Outbox) -> AsyncEngine:
    return made.engine()


def test_a_pooled_engine_is_refused_on_another_event_loop(tmp_path: Path) -> None:
    made = outbox(tmp_path)
    asyncio.run(engine_here(made))  # made on this loop
    with pytest.raises(StagingError) as refused:
        asyncio.run(engine_here(made))  # a new loop, as Flask's next async view
    assert "was made on another event loop" in str(refused.value)
    assert "SyncOutbox" in str(refused.value)
    assert "outbox.engine(poolclass=sqlalchemy.pool.NullPool)" in str(refused.value)


def test_an_engine_made_before_any_loop_belongs_to_the_first_loop_that_uses_it(
    tmp_path: Path,
) -> None:
    made = outbox(tmp_path)
    made.engine()  # at start-up, outside any loop
    asyncio.run(engine_here(made))
    with pytest.raises(StagingError, match="was made on another event loop"):
        asyncio.run(engine_here(made))


def test_an_unpooled_engine_serves_every_loop(tmp_path: Path) -> None:
    made = outbox(tmp_path)
    engine = made.engine(poolclass=NullPool)
    assert asyncio.run(engine_here(made)) is engine
    assert asyncio.run(engine_here(made)) is engine
