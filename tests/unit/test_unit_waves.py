"""How an ``atomic`` target's batch is split into units and waves (``router.relay.delivery``):
units in the order their transactions committed on the streams they share, and no two units
of one wave on a stream."""

from __future__ import annotations

from router.relay.delivery import unit_waves, units_of
from router.relay.store import ClaimedRow


def row(seq: int, unit: int | None, key: str | None) -> ClaimedRow:
    return ClaimedRow(seq, f"m{seq}", "d", "{}", 1, key, unit=unit)


def seqs(split: list[list[list[ClaimedRow]]]) -> list[list[list[int]]]:
    return [[[r.seq for r in unit] for unit in wave] for wave in split]


def test_units_go_in_the_order_of_their_last_rows() -> None:
    # Transaction 20 staged on "j" first (seq 1), then waited for 10's commit on "k": all of
    # 20's rows on "k" come after 10's, and so does 20's last row. 10 must go first.
    rows = [row(1, 20, "j"), row(2, 10, "k"), row(3, 10, "k"), row(4, 20, "k")]
    assert [[r.seq for r in u] for u in units_of(rows)] == [[2, 3], [1, 4]]


def test_a_unit_waits_for_the_wave_after_every_unit_it_shares_a_stream_with() -> None:
    rows = [
        row(1, 10, "a"),
        row(2, 10, "b"),
        row(3, 20, "c"),  # shares nothing: first wave
        row(4, 30, "b"),  # after 10
        row(5, 40, "a"),  # after 10 too, not after 30
        row(6, 50, "b"),
        row(7, 50, "c"),  # after 30 (b) and 20 (c)
    ]
    assert seqs(unit_waves(units_of(rows))) == [
        [[1, 2], [3]],
        [[4], [5]],
        [[6, 7]],
    ]


def test_rows_without_a_unit_or_a_stream_go_alone_in_the_first_wave() -> None:
    rows = [row(1, None, None), row(2, None, None), row(3, 10, None), row(4, 10, None)]
    assert seqs(unit_waves(units_of(rows))) == [[[1], [2], [3, 4]]]
