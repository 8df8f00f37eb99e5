"""The per-target circuit breaker: when it opens, how it probes, when it closes."""

from __future__ import annotations

import pytest

from router.config import CircuitSettings, RetrySettings
from router.relay.circuit import Circuit

RETRY = RetrySettings(max_attempts=10, base_delay=1.0, max_delay=30.0, jitter=0.2)


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_circuit_opens_only_after_being_unreachable_for_open_after_seconds() -> None:
    clock = Clock()
    circuit = Circuit(
        CircuitSettings(open_after=5, probe_max_delay=8), RETRY, clock=clock, rand=lambda: 0.5
    )
    circuit.unreachable("down")
    clock.now += 4
    circuit.unreachable("down")
    assert not circuit.is_open
    clock.now += 1
    circuit.unreachable("down")
    assert circuit.is_open
    assert circuit.probe_in() == pytest.approx(1.0)


def test_probes_back_off_up_to_their_ceiling_and_success_closes_the_circuit() -> None:
    clock = Clock()
    circuit = Circuit(
        CircuitSettings(open_after=0, probe_max_delay=3), RETRY, clock=clock, rand=lambda: 0.5
    )
    circuit.unreachable("down")
    waits = [circuit.probe_in()]
    for _ in range(4):
        clock.now += circuit.probe_in()
        circuit.probe_failed("still down")
        waits.append(circuit.probe_in())
    assert waits == [pytest.approx(w) for w in (1.0, 2.0, 3.0, 3.0, 3.0)]
    circuit.reachable()
    assert not circuit.is_open
    assert circuit.unreachable_since is None


def test_a_success_between_failures_resets_the_outage_clock() -> None:
    clock = Clock()
    circuit = Circuit(CircuitSettings(open_after=5), RETRY, clock=clock)
    circuit.unreachable("down")
    clock.now += 4
    circuit.reachable()
    clock.now += 2
    circuit.unreachable("down")
    assert not circuit.is_open
