"""The chaos report's time figures on hand-made timelines: no services, milliseconds."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from tests.chaos.ledger import units_in_part
from tests.chaos.report import (
    Report,
    Stall,
    delay_figures,
    disruptions_near,
    longest_stall,
    percentile,
    wakeup_changes,
    worker_starts,
)


def test_percentile_is_a_measured_value_by_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]  # 1 .. 100
    assert percentile(values, 0.5) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile(values, 1.0) == 100.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0
    assert percentile([7.0], 0.99) == 7.0
    assert percentile([], 0.5) == 0.0


def test_delay_figures_are_ordered_and_never_negative() -> None:
    figures = delay_figures([0.3, -0.001, 0.1, 2.5, 0.2])
    assert figures == (0.2, 2.5, 2.5)
    assert figures.p50 <= figures.p99 <= figures.max
    assert delay_figures([]) == (0.0, 0.0, 0.0)


def test_one_event_at_a_time_stalls_no_longer_than_its_own_delay() -> None:
    commits = {"a": 0.0, "b": 1.0, "c": 2.0}
    delivered = {"a": 0.1, "b": 1.1, "c": 2.1}
    assert longest_stall(commits, delivered).seconds == pytest.approx(0.1)


def test_a_stall_runs_from_the_last_delivery_to_the_next_while_an_event_waits() -> None:
    # b waits from 1.0; a's delivery at 1.2 ends nothing (b still waits); none until 5.0.
    commits = {"a": 0.0, "b": 1.0, "c": 2.0}
    delivered = {"a": 1.2, "b": 5.0, "c": 5.1}
    assert longest_stall(commits, delivered) == pytest.approx((3.8, 1.2))


def test_an_idle_stretch_with_nothing_waiting_is_not_a_stall() -> None:
    # Nothing is committed between 1.1 and 10.0: a quiet outbox, not a stuck one.
    commits = {"a": 0.0, "b": 10.0}
    delivered = {"a": 1.0, "b": 10.5}
    assert longest_stall(commits, delivered) == pytest.approx((1.0, 0.0))


def test_a_stall_begins_at_the_first_commit_after_an_idle_stretch() -> None:
    commits = {"a": 0.0, "b": 4.0, "c": 4.5}
    delivered = {"a": 0.2, "b": 7.0, "c": 7.1}
    assert longest_stall(commits, delivered) == pytest.approx((3.0, 4.0))


def test_a_repeat_or_a_foreign_message_delivered_ends_a_stall_too() -> None:
    # "x" was never in the ledger (its commit outcome unknown), yet it shows the relay moved.
    commits = {"a": 0.0, "b": 0.5}
    delivered = {"a": 0.1, "x": 2.0, "b": 4.0}
    assert longest_stall(commits, delivered) == pytest.approx((2.0, 2.0))


def test_an_event_never_delivered_waits_until_the_end() -> None:
    commits = {"a": 0.0, "lost": 1.0}
    delivered = {"a": 0.5}
    assert longest_stall(commits, delivered, end=9.0) == Stall(8.0, 1.0)
    # Without an end, its wait is not counted: the longest is a's.
    assert longest_stall(commits, delivered).seconds == 0.5


def test_a_delivery_timed_before_its_commit_counts_as_committed_then() -> None:
    # The producer times its commit after COMMIT returns; the router may be quicker.
    assert longest_stall({"a": 1.0}, {"a": 0.99}) == Stall(0.0, 0.0)


def test_no_events_no_stall() -> None:
    assert longest_stall({}, {}) == Stall(0.0, 0.0)


def test_disruptions_near_a_stall_include_one_a_moment_before_it_began() -> None:
    timeline = [(3.0, "worker kill"), (9.6, "broker kill"), (10.5, "broker back"), (20.0, "x")]
    assert disruptions_near(timeline, 10.0, 12.0) == [(9.6, "broker kill"), (10.5, "broker back")]


def test_worker_starts_pairs_started_and_ready_lines_by_pid() -> None:
    def line(event: str, **fields: object) -> str:
        return json.dumps({"time": "t", "level": "info", "event": event, **fields})

    lines = [
        line("worker.started", worker=0, pid=10),
        line("worker.started", worker=1, pid=11),
        "Traceback (most recent call last):",
        '{"not json',
        line("worker.ready", worker=0, pid=10, seconds=1.25),
        line("worker.started", worker=0, pid=12),
        line("worker.ready", worker=0, pid=12, seconds=0.75),
        line("processor.started", worker="w"),
    ]
    starts = worker_starts(lines)
    assert starts.started == [10, 11, 12]
    assert starts.ready == {10: 1.25, 12: 0.75}
    assert starts.never_ready == [11]

    report = Report("small", 10, 1)
    report.set_worker_starts(starts, disrupted={11})
    assert (report.workers_started, report.workers_ready, report.workers_never_ready) == (3, 2, 1)
    assert report.workers_never_ready_disrupted == 1
    assert (report.ready_median_seconds, report.ready_max_seconds) == (1.0, 1.25)


def test_wake_up_figures_come_from_the_relay_s_log_lines_and_the_cuts() -> None:
    def line(second: float, event: str, **fields: object) -> str:
        time = datetime.fromtimestamp(second, UTC).isoformat()
        return json.dumps({"time": time, "level": "info", "event": event, **fields})

    lines = [
        line(100.0, "worker.started", pid=10),
        line(100.5, "wakeup.active", mechanism="log", reason="slot router_wakeup_a"),
        line(100.6, "wakeup.active", mechanism="log", reason="slot router_wakeup_b"),
        # Cut at 110.0 (two connections): both fall back at once, both come back.
        line(110.01, "wakeup.fallback", mechanism="notify", reason="log lost"),
        line(110.02, "wakeup.fallback", mechanism="notify", reason="log lost"),
        line(110.6, "wakeup.active", mechanism="log", reason="slot router_wakeup_c"),
        line(111.1, "wakeup.active", mechanism="log", reason="slot router_wakeup_d"),
        # Cut at 130.0 (two): one falls back, late, and neither comes back.
        line(133.0, "wakeup.fallback", mechanism="poll", reason="binlog connection lost"),
    ]
    changes = wakeup_changes(lines)
    assert [c.event for c in changes].count("wakeup.fallback") == 3
    assert changes[0].at == pytest.approx(100.5)

    report = Report("small", 10, 1, wakeup="log", wake_cuts=2, wake_connections_cut=4)
    report.set_wakeups(changes, cuts=[(110.0, 2), (130.0, 2)])
    assert report.wake_first == "log"
    assert (report.wake_log_starts, report.wake_fallbacks) == (4, 3)
    assert report.wake_cuts_recovered == 1
    assert "2 times, 4 connections (1)" in report.table()
    assert report.to_json()["wake_cuts_recovered"] == 1


def test_the_table_and_json_carry_the_time_figures() -> None:
    report = Report("small", 10, 1, duplicated=6, worker_kills=4, graceful_stops=2)
    report.set_delays([0.1, 0.2, 0.3])
    report.longest_stall_seconds, report.longest_stall_from_seconds = 2.5, 30.0
    report.disruptions = [(29.8, "broker kill"), (31.0, "broker back")]
    table = report.table()
    assert "p50 (s)  " in table
    assert "2.500 from 30.0 s: broker kill at 29.8, broker back at 31.0" in table
    document = report.to_json()
    assert document["duplicates_per_kill"] == 1.5
    assert document["p50_delay_seconds"] == 0.2
    assert json.loads(json.dumps(document))["graceful_stops"] == 2


def test_a_transaction_is_seen_in_part_unless_each_copy_is_one_whole_contiguous_batch() -> None:
    one, two = frozenset({"a", "b", "c"}), frozenset({"d", "e"})
    units = dict.fromkeys(one, one) | dict.fromkeys(two, two)
    whole = {"x": [(3, "b"), (2, "a"), (4, "c")], "y": [(5, "d"), (6, "e")]}
    assert units_in_part(units, whole, []) == []
    # Stored again, whole, in a batch of its own later: still never seen in part.
    assert units_in_part(units, {**whole, "z": [(9, "d"), (10, "e")]}, []) == []
    # A batch short of a member, one with a gap in its sequences, a member outside any batch.
    assert units_in_part(units, {"x": [(2, "a"), (3, "b")]}, []) == ["a"]
    assert units_in_part(units, {"x": [(2, "a"), (3, "b"), (5, "c")]}, []) == ["a"]
    assert units_in_part(units, whole, ["e"]) == ["d"]
    # Two whole transactions in one batch, each at contiguous sequences: never seen in part;
    # interleaved, both are.
    assert units_in_part(units, {"x": [(1, "a"), (2, "b"), (3, "c"), (4, "d"), (5, "e")]}, []) == []
    interleaved = {"x": [(1, "a"), (2, "d"), (3, "b"), (4, "c"), (5, "e")]}
    assert sorted(units_in_part(units, interleaved, [])) == ["a", "d"]
