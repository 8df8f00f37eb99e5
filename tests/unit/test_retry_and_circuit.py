"""The retry schedule and the circuit breaker's states."""

from __future__ import annotations

import pytest

from router.circuit import Circuit
from router.config import CircuitSettings, RetrySettings
from router.retry import delay_bounds, retry_delay

RETRY = RetrySettings(max_attempts=10, base_delay=1.0, max_delay=30.0, jitter=0.2)


@pytest.mark.parametrize(
    ("attempt", "expected"), [(1, 1.0), (2, 2.0), (3, 4.0), (5, 16.0), (6, 30.0), (40, 30.0)]
)
def test_delays_double_from_the_base_and_stop_at_the_cap(attempt: int, expected: float) -> None:
    assert retry_delay(attempt, RETRY, lambda: 0.5) == pytest.approx(expected)


def test_jitter_spreads_each_delay_within_its_bounds() -> None:
    low, high = delay_bounds(3, RETRY)
    assert (low, high) == pytest.approx((3.2, 4.8))
    assert retry_delay(3, RETRY, lambda: 0.0) == pytest.approx(low)
    assert retry_delay(3, RETRY, lambda: 1.0) == pytest.approx(high)


def test_enormous_attempt_numbers_stay_capped() -> None:
    assert retry_delay(10**6, RETRY, lambda: 0.5) == pytest.approx(30.0)


class Clock:
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
