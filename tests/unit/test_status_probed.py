"""`router status --watch` asks for the wake-up once a minute, not at every redraw: each ask
opens a connection to every database, and the answer changes only when the server does."""

from __future__ import annotations

from router.cli.status import WAKEUP_EVERY, Probed


async def test_a_watch_asks_for_the_wake_up_again_only_once_its_answer_is_old() -> None:
    now = [0.0]
    asked: list[float] = []

    async def probe() -> list[str]:
        asked.append(now[0])
        return [f"answer {len(asked)}"]

    probed = Probed(probe, WAKEUP_EVERY, clock=lambda: now[0])
    shown = []
    for _ in range(30):  # a redraw every 2 s (the default) for a minute
        shown.append(await probed.reports())
        now[0] += 2.0
    shown.append(await probed.reports())  # at 60 s: asked again

    assert asked == [0.0, 60.0]
    assert shown[0] == shown[29] == ["answer 1"]
    assert shown[30] == ["answer 2"]
