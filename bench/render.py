"""render: what the partner allow-list costs per message when a processor renders a row.

    python -m bench.render [--messages 20000] [--rounds 7]

One stored envelope, as ``stage()`` writes it (a realistic payload of 8 fields, two staged
headers, two extensions, a correlation id and a stream key), rendered the way a processor
renders each row (``envelopes.render``, parse and dump included) for:

- ``internal``: the internal profile (the stored bytes plus ``sequence``, no parse);
- ``external``: a partner with no ``expose`` (the default: staged headers and extensions
  dropped, the whole payload);
- ``external + allow-list``: headers and extensions allowed by glob, one internal field;
- ``external + projection``: the same, and a payload projection keeping 3 of 8 fields;
- ``cloudevents + projection``: the same allow-list and projection in CloudEvents structured
  mode;
- ``hand-written projection``: the least a renderer could do for the projected case, with
  the same body and headers as ``external + projection``: ``orjson.loads``, a dict
  comprehension per map, ``orjson.dumps``, the headers dict; the names to keep written in,
  no allow-list to apply, no omit, no checks. The baseline.

Cases take turns within each round (a block of every case, then the next block), so drift
hits them alike; the figure is microseconds per message, median of the rounds, with the
fastest and slowest round as its spread.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import orjson

from bench._common import median, print_table, write_results
from envelopes import Exposure, WireMessage, make_internal_envelope, render

PAYLOAD = {
    "order_id": "0190a5d4-ac96-774b-bcce-b302099a8057",
    "customer": "ada@example.com",
    "total": "142.50",
    "currency": "EUR",
    "lines": 3,
    "shipping_address": {"street": "1 Main St", "city": "Ghent", "country": "BE"},
    "card_last4": "4242",
    "placed_at": "2026-11-23T10:00:00Z",
}
KEPT = frozenset({"order_id", "total", "currency"})
STORED = make_internal_envelope(
    message_id="0190a5d4-ac96-774b-bcce-b302099a8058",
    event_type="orders.order_placed",
    version=2,
    time=datetime(2026, 11, 23, 10, 0, tzinfo=UTC),
    source="shop",
    payload_json=orjson.dumps(PAYLOAD),
    stream="0190a5d4-ac96-774b-bcce-b302099a8057",
    correlation_id="checkout-0190a5d4",
    headers={"x-tenant": "acme", "x-internal-secret": "s3cr3t"},
    extensions={"region": "eu", "cost": "12"},
    tenant="acme",
    event_class="shop.events.OrderPlaced",
)
ALLOW = Exposure(headers=("x-tenant",), extensions=("reg*",), fields=frozenset({"tenant"}))
PROJECT = Exposure(
    headers=("x-tenant",),
    extensions=("reg*",),
    fields=frozenset({"tenant"}),
    payload={"orders.order_placed": KEPT},
)
PARTNER = ("id", "type", "version", "time", "source", "stream", "correlation_id", "tenant")


def by_hand(stored: bytes) -> WireMessage:
    """The projected partner message, as ``render`` makes it (same body, same headers), with
    nothing but the work itself: the names to keep are known in advance."""
    envelope = orjson.loads(stored)
    body = {k: envelope[k] for k in PARTNER if k in envelope}
    body["extensions"] = {"region": envelope["extensions"]["region"]}
    body["payload"] = {k: v for k, v in envelope["payload"].items() if k in KEPT}
    headers = {
        "x-tenant": envelope["headers"]["x-tenant"],
        "message-id": envelope["id"],
        "event-type": envelope["type"],
        "event-version": str(envelope["version"]),
        "source": envelope["source"],
        "stream-key": envelope["stream"],
        "correlation-id": envelope["correlation_id"],
        "content-type": "application/json",
    }
    return WireMessage(
        envelope["id"], envelope["type"], orjson.dumps(body), "application/json", headers
    )


CASES: dict[str, Callable[[], Any]] = {
    "internal": lambda: render(STORED, "internal", sequence=42),
    "external": lambda: render(STORED, "external", sequence=42),
    "external + allow-list": lambda: render(STORED, "external", sequence=42, exposure=ALLOW),
    "external + projection": lambda: render(STORED, "external", sequence=42, exposure=PROJECT),
    "cloudevents + projection": lambda: render(
        STORED, "cloudevents", sequence=42, exposure=PROJECT
    ),
    "hand-written projection": lambda: by_hand(STORED),
}


def main() -> None:
    """Measure, print, save."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000, help="renders per case a round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    block = 1_000
    spent: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(args.rounds):
        totals = dict.fromkeys(CASES, 0.0)
        for _ in range(args.messages // block):
            for name, case in CASES.items():
                started = time.perf_counter()
                for _ in range(block):
                    case()
                totals[name] += time.perf_counter() - started
        for name, seconds in totals.items():
            spent[name].append(seconds / (args.messages // block * block) * 1e6)
    baseline = median(spent["hand-written projection"])
    rows, figures = [], {}
    for name, rounds in spent.items():
        figure = median(rounds)
        figures[name] = {
            "us_per_message": round(figure, 2),
            "fastest_round": round(min(rounds), 2),
            "slowest_round": round(max(rounds), 2),
            "vs_hand_written": round(figure / baseline, 2),
        }
        rows.append(
            (
                name,
                f"{figure:.2f}",
                f"{min(rounds):.2f}-{max(rounds):.2f}",
                f"{figure / baseline:.2f}x",
                f"{len(CASES[name]().body):,}",
            )
        )
    print_table(
        f"render: us per message, median of {args.rounds} rounds x {args.messages:,} messages",
        ["case", "us/message", "rounds", "vs hand-written", "body bytes"],
        rows,
    )
    path = write_results(
        "render", {"messages": args.messages, "rounds": args.rounds, "block": block}, figures
    )
    print(f"written to {path.relative_to(path.parents[2])}")


if __name__ == "__main__":
    main()
