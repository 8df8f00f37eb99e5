"""Envelope metadata is declared once (``envelopes/metadata.py``): the envelope models, the
stored envelope, its rendering, ``omit`` and ``stage()``'s keywords all follow from it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from envelopes import (
    EXTERNAL_FIELDS,
    EnvelopeMetadata,
    ExternalEnvelope,
    InternalEnvelope,
    Metadata,
    PartnerMetadata,
    StageOptions,
)

ROOT = Path(__file__).resolve().parents[2]


def test_stage_options_name_every_metadata_field_but_the_stream() -> None:
    assert set(StageOptions.__optional_keys__) == set(Metadata.model_fields) - {"stream"}
    assert set(EnvelopeMetadata.__optional_keys__) == set(Metadata.model_fields)


def test_the_envelope_models_are_made_of_the_metadata() -> None:
    assert set(Metadata.model_fields) <= set(InternalEnvelope.model_fields)
    assert set(PartnerMetadata.model_fields) <= set(ExternalEnvelope.model_fields)
    internal_only = set(Metadata.model_fields) - set(PartnerMetadata.model_fields)
    assert not internal_only & set(EXTERNAL_FIELDS)


# The two edits a new field takes: declare it on PartnerMetadata, add its stage() keyword.
FIELD = """
    reply_to: Annotated[str | None, Wire("reply-to", "replyto")] = Field(
        None, description="Where the partner may answer."
    )
"""
KEYWORD = "    reply_to: str | None\n"

SCRIPT = """
import asyncio
import orjson
from envelopes import ExternalEnvelope, StagingError, render
from router import Event, RouterConfig
from router.write.staging import Stager

class Placed(Event, type="orders.placed", published=True):
    order_id: str

config = RouterConfig.model_validate({
    "service": "shop",
    "databases": {"main": "sqlite:///x.db"},
    "brokers": {
        "events": {"type": "memory", "internal": True},
        "partner": {"type": "memory", "envelope": "external"},
        "cloud": {"type": "memory", "envelope": "cloudevents"},
        "quiet": {"type": "memory", "envelope": "external", "omit": ["reply_to"]},
    },
    "http": {"enabled": False},
})
rows = Stager(config).build_rows("main", [Placed(order_id="o-1")], reply_to="billing.replies")
stored = rows[0].envelope
seen = {}
for profile, omit in (("internal", ()), ("external", ()), ("cloudevents", ()), ("external", ["reply_to"])):
    message = render(stored, profile, omit=omit)
    body = orjson.loads(message.body)
    seen[f"{profile}{'-omit' if omit else ''}"] = (
        body.get("reply_to", body.get("replyto")), message.headers.get("reply-to")
    )
print(seen)
print(ExternalEnvelope.model_validate_json(render(stored, "external").body).reply_to)
try:
    Stager(config).build_rows("main", [Placed(order_id="o-1")], reply_to=5)
except StagingError as exc:
    print(exc)
"""


def test_a_new_field_takes_two_edits_and_reaches_every_profile(tmp_path: Path) -> None:
    for package in ("envelopes", "brokers", "router"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("*.pyc"))
    metadata = tmp_path / "envelopes" / "metadata.py"
    source = metadata.read_text()
    anchor = '        description="Attributes for partners (CloudEvents extension attributes).",\n    )\n'
    keyword_anchor = "    headers: Mapping[str, str] | None\n"
    assert source.count(anchor) == 1 and source.count(keyword_anchor) == 1
    source = source.replace(anchor, anchor + FIELD).replace(
        keyword_anchor, keyword_anchor + KEYWORD
    )
    metadata.write_text(source)

    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == str(
        {
            "internal": ("billing.replies", "billing.replies"),
            "external": ("billing.replies", "billing.replies"),
            "cloudevents": ("billing.replies", "billing.replies"),
            "external-omit": (None, None),
        }
    )
    assert lines[1] == "billing.replies"
    assert lines[2] == "reply_to must be a string, got int"
