"""One verdict per atomic unit (``brokers.unit_verdict``): what each member's outcome makes
of the whole unit."""

from __future__ import annotations

from brokers import PublishResult, unit_verdict

IDS = ["id-1", "id-2", "id-3"]


def test_a_unit_whose_members_are_all_acknowledged_keeps_their_receipts() -> None:
    members = [PublishResult.acked(f'{{"seq":{n}}}') for n in (1, 2, 3)]
    assert unit_verdict(members, IDS) == members


def test_a_refused_member_fails_every_member_with_its_reason_and_retryability() -> None:
    members = [
        PublishResult.acked(),
        PublishResult.cut_off("no ack within publish_timeout"),
        PublishResult.failed("message size exceeds maximum allowed", retryable=False),
    ]
    verdict = unit_verdict(members, IDS)
    assert len(set(verdict)) == 1 and len(verdict) == 3
    assert verdict[0] == PublishResult.failed(
        "atomic unit of 3 refused: member 3 (id-3): message size exceeds maximum allowed",
        retryable=False,
    )


def test_a_unit_with_a_member_cut_off_and_none_refused_is_cut_off_whole() -> None:
    members = [
        PublishResult.acked(),
        PublishResult.cut_off("NATS connection lost before the ack"),
        PublishResult.acked(),
    ]
    verdict = unit_verdict(members, IDS)
    assert verdict == [PublishResult.cut_off("NATS connection lost before the ack")] * 3
    assert all(r.unreachable for r in verdict)
