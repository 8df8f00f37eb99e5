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


def test_the_circuit_opens_at_the_first_unanswered_publish_and_probes_soon() -> None:
    clock = Clock()
    circuit = Circuit(CircuitSettings(probe_max_delay=8), RETRY, clock=clock, rand=lambda: 0.5)
    circuit.cut_off("no ack within publish_timeout")
    assert circuit.is_open
    assert circuit.reason == "no ack within publish_timeout"
    assert circuit.probe_in() == pytest.approx(0.25)


def test_probes_back_off_up_to_their_ceiling_and_success_puts_the_circuit_on_trial() -> None:
    clock = Clock()
    circuit = Circuit(CircuitSettings(probe_max_delay=3), RETRY, clock=clock, rand=lambda: 0.5)
    circuit.cut_off("down")
    waits = [circuit.probe_in()]
    for _ in range(5):
        clock.now += circuit.probe_in()
        circuit.probe_failed("still down")
        waits.append(circuit.probe_in())
    assert waits == [pytest.approx(w) for w in (0.25, 0.5, 1.0, 2.0, 3.0, 3.0)]
    circuit.probed()
    assert not circuit.is_open
    assert circuit.trial
    assert circuit.reason == "still down"  # nothing answered yet but the probe
    circuit.reachable()
    assert not circuit.trial
    assert circuit.reason is None
    assert circuit.unreachable_since is None


def test_a_publish_unanswered_on_trial_opens_the_circuit_again() -> None:
    clock = Clock()
    circuit = Circuit(CircuitSettings(), RETRY, clock=clock, rand=lambda: 0.5)
    circuit.cut_off("silent")
    clock.now += circuit.probe_in()
    circuit.probed()
    circuit.cut_off("silent again")
    assert circuit.is_open
    assert not circuit.trial
    assert circuit.probe_in() == pytest.approx(0.25)  # its probes start over
