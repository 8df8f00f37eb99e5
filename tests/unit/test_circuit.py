"""The per-target circuit breaker: when it opens, how it probes, when it closes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from router.config import CircuitSettings, RetrySettings
from router.relay.circuit import SIBLING, Circuit
from router.relay.host_circuits import ENVIRONMENT, HostCircuits

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


@pytest.fixture
def host_circuits(tmp_path: Path) -> Iterator[HostCircuits]:
    path = str(tmp_path / "circuits")
    HostCircuits.create(path, ["main/events", "main/partner"])
    circuits = HostCircuits(path)
    yield circuits
    circuits.close()


def sibling_circuits(circuits: HostCircuits, clock: Clock) -> tuple[Circuit, Circuit]:
    """Two workers' circuits for one target, each mapping the file on its own."""
    made = []
    for _ in range(2):
        word = HostCircuits(circuits.path).word("main", "events")
        assert word is not None
        made.append(
            Circuit(
                CircuitSettings(probe_max_delay=3),
                RETRY,
                clock=clock,
                rand=lambda: 0.5,
                shared=word,
            )
        )
    return made[0], made[1]


def test_a_workers_cut_off_stops_its_siblings_claims_and_their_own_probes_follow(
    host_circuits: HostCircuits,
) -> None:
    clock = Clock()
    first, second = sibling_circuits(host_circuits, clock)
    assert not second.is_open
    first.cut_off("events: no answer within 0.5 s, nor to a ping within 0.5 s")
    assert second.is_open
    assert second.reason == SIBLING
    assert second.probe_in() == pytest.approx(0.25)
    # The sibling's probe gets through: both claim again, on trial.
    clock.now += 0.25
    second.probed()
    assert not first.is_open
    assert first.trial and second.trial
    first.reachable()
    assert not first.trial
    assert not first.is_open and not second.is_open


def test_a_sibling_that_opens_again_on_trial_stops_the_others_again(
    host_circuits: HostCircuits,
) -> None:
    clock = Clock()
    first, second = sibling_circuits(host_circuits, clock)
    first.cut_off("down")
    assert second.is_open
    first.probed()
    assert not second.is_open
    second.cut_off("still down")  # its trial publish went unanswered
    assert first.is_open
    assert first.reason == "down"  # its own words are kept


def test_the_shared_word_crosses_processes(host_circuits: HostCircuits) -> None:
    word = host_circuits.word("main", "partner")
    assert word is not None
    assert word.read() == (0, False)
    pid = os.fork()
    if pid == 0:  # the child: another worker, opening the circuit
        child = HostCircuits(host_circuits.path).word("main", "partner")
        os._exit(0 if child is not None and child.write(True) == 1 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert word.read() == (1, True)
    assert host_circuits.word("main", "events").read() == (0, False)  # type: ignore[union-attr]


def test_a_target_the_parent_did_not_name_has_no_word_and_a_missing_file_shares_nothing(
    host_circuits: HostCircuits, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert host_circuits.word("main", "added-since") is None
    monkeypatch.setenv(ENVIRONMENT, str(tmp_path / "gone"))
    assert HostCircuits.from_environment() is None
    monkeypatch.setenv(ENVIRONMENT, host_circuits.path)
    found = HostCircuits.from_environment()
    assert found is not None
    found.close()
