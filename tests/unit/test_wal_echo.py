"""The log followers' echo (``router.relay.store.base.Echo``): a commit read from the log may
not be visible yet to the claim it wakes, so every wake-up comes once more, a moment later."""

from __future__ import annotations

import asyncio

from router.relay.store.base import Echo


async def test_a_wake_up_is_echoed_once_with_every_target_woken_meanwhile() -> None:
    woken: list[set[str] | None] = []
    echo = Echo(woken.append, after=0.02)
    echo({"a"})
    echo({"b"})
    assert woken == [{"a"}, {"b"}]
    await asyncio.sleep(0.05)
    assert woken == [{"a"}, {"b"}, {"a", "b"}]
    await asyncio.sleep(0.05)
    assert len(woken) == 3, "one echo, not a loop"


async def test_waking_every_target_makes_the_echo_wake_every_target() -> None:
    woken: list[set[str] | None] = []
    echo = Echo(woken.append, after=0.02)
    echo({"a"})
    echo(None)
    echo({"b"})
    await asyncio.sleep(0.05)
    assert woken[-1] is None


async def test_a_cancelled_echo_never_comes() -> None:
    woken: list[set[str] | None] = []
    echo = Echo(woken.append, after=0.02)
    echo({"a"})
    echo.cancel()
    await asyncio.sleep(0.05)
    assert woken == [{"a"}]


async def test_a_later_wake_up_gets_its_full_delay_before_the_echo() -> None:
    woken: list[set[str] | None] = []
    echo = Echo(woken.append, after=0.05)
    echo({"a"})
    await asyncio.sleep(0.03)
    echo({"b"})
    await asyncio.sleep(0.035)  # 65 ms after the first, 35 ms after the second
    assert woken == [{"a"}, {"b"}]
    await asyncio.sleep(0.05)
    assert woken == [{"a"}, {"b"}, {"a", "b"}]
