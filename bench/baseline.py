"""baseline: the strongest relay we could write by hand in a page, as a program of its own.

    python -m bench.baseline --dsn DSN --nats URL [--batch 500] [--events N] [--hold]

uvloop, asyncpg and nats-py's public API; one connection to each. Until a claim comes back
empty: claim a batch by primary key (``FOR UPDATE SKIP LOCKED``), publish all of it with every
ack in flight on one reply subject, mark it published with one UPDATE. It exits 0 once it has
published ``--events`` messages (when given), 1 otherwise. bench.drain times it from exec, as
it times ``router serve``.

Two ways to claim:

- by default, as issue #16 describes the baseline and as most outbox relays do: the claim is
  an UPDATE that leases the rows ('processing', a lease end), so every row is written twice
  (claimed, then published);
- ``--hold``: the batch's transaction stays open while it is published, the rows' locks are
  the lease, and each row is written once (published). This is what the router does on
  PostgreSQL since migration 0010, and the stronger relay.

What it leaves out, and why it may: per-stream order needs no check, because one relay runs
alone and waits for every ack of a batch before it claims again, so no stream is ever in two
batches at once (a second relay would need the router's check on ``stream_key``); and there is
no retry path: a refused publish ends the program, so its rows stay leased.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import asyncpg
import nats
import uvloop

# The partial index ix_router_outbox_claim (target, seq) WHERE status IN ('pending', 'failed')
# serves the inner SELECT: its predicate is the index's, word for word, and ``seq >=`` the
# first queued row keeps the scan off the published rows, as router_claim() does
# (statistics, which a fresh backlog lacks, could not tell the planner they come first). A
# row this relay claimed leaves that index; after a crash its rows stay 'processing' (the
# router gives such rows back once their lease ends; this page of code does not).
# The outer UPDATE takes the picked keys as an array: ``seq IN (subquery)`` is planned as a
# hash join over the whole table.
CLAIM = """
UPDATE router_outbox SET status = 'processing', locked_until = now() + interval '30 s',
    attempts = attempts + 1
WHERE seq = ANY(ARRAY(
    SELECT seq FROM router_outbox
    WHERE target = 'events' AND status IN ('pending', 'failed') AND available_at <= now()
      AND seq >= (SELECT min(seq) FROM router_outbox
                  WHERE target = 'events' AND status IN ('pending', 'failed'))
    ORDER BY seq LIMIT $1
    FOR UPDATE SKIP LOCKED))
RETURNING seq, message_id::text, destination, envelope::text
"""
MARK = """
UPDATE router_outbox SET status = 'published', published_at = now(), locked_until = NULL
WHERE seq = ANY($1::bigint[])
"""
# --hold: the same choice of rows, locked and read, not written; the mark counts the attempt.
LOCK = """
SELECT seq, message_id::text, destination, envelope::text FROM router_outbox
WHERE target = 'events' AND status IN ('pending', 'failed') AND available_at <= now()
  AND seq >= (SELECT min(seq) FROM router_outbox
              WHERE target = 'events' AND status IN ('pending', 'failed'))
ORDER BY seq LIMIT $1
FOR UPDATE SKIP LOCKED
"""
MARK_HELD = """
UPDATE router_outbox SET status = 'published', published_at = now(), attempts = attempts + 1
WHERE seq = ANY($1::bigint[])
"""


class Acks:
    """Counts the JetStream acks of the batch in flight; fails on the first error reply."""

    def __init__(self) -> None:
        self.remaining = 0
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def expect(self, count: int) -> asyncio.Future[None]:
        """A future that completes once ``count`` more acks have arrived."""
        self.remaining = count
        self.done = asyncio.get_running_loop().create_future()
        return self.done

    async def on_reply(self, msg: Any) -> None:
        """A PubAck is ``{"stream": ..., "seq": ...}``; an error has ``"error"``, a 503 (no
        stream captures the subject) no body."""
        if not msg.data or b'"error"' in msg.data:
            if not self.done.done():
                self.done.set_exception(RuntimeError(f"JetStream refused: {msg.data[:200]!r}"))
            return
        self.remaining -= 1
        if self.remaining == 0 and not self.done.done():
            self.done.set_result(None)


async def relay(dsn: str, nats_url: str, batch: int, hold: bool) -> int:
    """Drain the outbox into JetStream; the number of messages published."""
    conn = await asyncpg.connect(dsn)
    # As the router's own bookkeeping: a claim or mark lost in a crash is only delivered again.
    await conn.execute("SET synchronous_commit = off")
    # Without statistics (a fresh backlog), once part of it is published the planner reads
    # every open row through the claim index and sorts them; without sorts it walks the index
    # in seq order and stops at the batch: a fifth less time in claims over a drain.
    await conn.execute("SET enable_sort = off")
    client = await nats.connect(nats_url)
    acks, inbox, published = Acks(), client.new_inbox(), 0
    await client.subscribe(inbox, cb=acks.on_reply)
    claim, mark = (LOCK, MARK_HELD) if hold else (CLAIM, MARK)
    try:
        while True:
            if hold:
                await conn.execute("BEGIN")
            rows = await conn.fetch(claim, batch)
            if not rows:
                break
            done = acks.expect(len(rows))
            # One reply subject for the whole batch: the acks are only counted.
            for _seq, message_id, destination, envelope in rows:
                await client.publish(
                    destination, envelope.encode(), reply=inbox, headers={"Nats-Msg-Id": message_id}
                )
            await asyncio.wait_for(done, 30)
            await conn.execute(mark, [row[0] for row in rows])
            if hold:
                await conn.execute("COMMIT")
            published += len(rows)
    finally:
        await client.close()
        await conn.close()
    return published


def main() -> None:
    """Parse, drain, exit 0 when the expected count was published."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--nats", default="nats://127.0.0.1:4222")
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--events", type=int, default=None, help="expected count")
    parser.add_argument("--hold", action="store_true", help="one write per row (see above)")
    args = parser.parse_args()
    published = uvloop.run(relay(args.dsn, args.nats, args.batch, args.hold))
    raise SystemExit(0 if args.events in (None, published) else 1)


if __name__ == "__main__":
    main()
