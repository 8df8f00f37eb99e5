"""``EnvelopeTemplate``: the stored envelope of stage()'s common call, from parts made once,
byte for byte what ``make_internal_envelope`` makes, and ``stage()`` building it so."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal

import pytest

from envelopes import EnvelopeError, EnvelopeTemplate, make_internal_envelope
from router.config import RouterConfig
from router.write.staging import Stager
from tests.integration.events import OrderPlaced

# Names a config may hold, and keys an application may stage: quotes, backslashes, controls,
# non-ASCII, characters JSON text must escape and the line separators JavaScript chokes on.
NAMES = ["orders.placed", 'say "hi"', "back\\slash", "ünïcödé/事件", "tab\tnew\nline"]
KEYS = [None, "", "order-7", 'q"uote', "back\\slash", "ctl\x01\x1f", "\u2028\u2029", "事件", "🙂"]
TIMES = [
    datetime(2026, 11, 29, 5, 53, 21, 536779, tzinfo=UTC),
    datetime(2026, 11, 29, 5, 53, 21, tzinfo=UTC),  # no fraction: isoformat's path
    datetime(2026, 11, 29, 7, 53, 21, 5, tzinfo=timezone(timedelta(hours=2))),
]
PAYLOADS = [b"{}", b'{"order_id":"7","total":"12.50"}', '{"x":"事件"}'.encode()]


@pytest.mark.parametrize("name", NAMES)
def test_the_template_makes_the_envelope_make_internal_envelope_makes(name: str) -> None:
    template = EnvelopeTemplate(event_type=name, version=3, source=name, event_class=name)
    for key in KEYS:
        for moment in TIMES:
            for payload in PAYLOADS:
                expected = make_internal_envelope(
                    message_id="01a225bb-a0c2-740b-9e20-cf5128cbd89f",
                    event_type=name,
                    version=3,
                    time=moment,
                    source=name,
                    payload_json=payload,
                    stream=key,
                    event_class=name,
                )
                made = template.make("01a225bb-a0c2-740b-9e20-cf5128cbd89f", moment, key, payload)
                assert made == expected
                assert json.loads(made)["stream"] == key if key is not None else True


def test_stage_builds_its_common_call_as_it_builds_any_other() -> None:
    """One event with a stream key or none and no metadata takes the class's plan; the same
    event given a metadata value that changes nothing (an empty header map) takes the general
    path. Their rows are the same but for the id and the time."""
    config = RouterConfig.model_validate(
        {
            "service": "shop",
            "databases": {"main": "sqlite:///x.db"},
            "brokers": {
                "events": {"type": "memory", "internal": True},
                "partner": {"type": "memory"},
            },
        }
    )
    stager = Stager(config)
    event = OrderPlaced(order_id="7", total=Decimal("12.50"), note='a "note" ü')
    for key in (None, "order-7", "事件\u2028"):
        planned = stager.build_rows("main", [event], stream_key=key)
        general = stager.build_rows("main", [event], stream_key=key, headers={})
        assert [r.target for r in planned] == [r.target for r in general] == ["events", "partner"]
        for one, other in zip(planned, general, strict=True):
            assert (one.destination, one.event_type, one.stream_key) == (
                other.destination,
                other.event_type,
                other.stream_key,
            )
            mine, theirs = json.loads(one.envelope), json.loads(other.envelope)
            assert mine.pop("id") == one.message_id and theirs.pop("id") == other.message_id
            mine.pop("time"), theirs.pop("time")
            assert mine == theirs
            assert list(json.loads(one.envelope)) == list(json.loads(other.envelope))


def test_names_that_hold_a_stand_in_leave_the_general_way_to_make_the_envelope() -> None:
    """A name holding the template's own time cannot be cut around: no template (stage()
    then builds such an event's envelope as any other)."""
    with pytest.raises(EnvelopeError, match="no envelope template"):
        EnvelopeTemplate(
            event_type="2001-02-03T04:05:06.789012Z", version=1, source="s", event_class="c"
        )
