"""The strongest relay a team would write by hand for the hand outbox of ``bench._writers``
(``hand_outbox``: uuid, target, type, key, jsonb payload, created_at, published_at; a partial
index on the pending rows), as a program of its own:

    python -m bench._hand_relay --dsn DSN --nats URL --subject PREFIX [--batch 500]
                                [--idle 0.01]

uvloop, asyncpg and nats-py, one connection to each, as ``bench.baseline`` relays the router's
table. In one transaction: lock a batch of pending rows in order (``FOR UPDATE SKIP LOCKED``,
the locks are the lease), publish all of it with every ack in flight on one reply subject,
set ``published_at``, commit. An empty claim sleeps ``--idle`` seconds: the writers send no
NOTIFY (which would cost them PostgreSQL's commit-time lock, as the router's ``stage()``
avoids), so the hand relay polls, as most hand-written relays do; 10 ms keeps its latency
close to the router's for 100 cheap queries a second while idle. It runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

import asyncpg
import nats
import uvloop

from bench.baseline import Acks

# The partial index hand_outbox_pending (created_at) WHERE published_at IS NULL serves it.
LOCK = """
SELECT id::text, type, payload::text FROM hand_outbox
WHERE published_at IS NULL
ORDER BY created_at LIMIT $1
FOR UPDATE SKIP LOCKED
"""
MARK = "UPDATE hand_outbox SET published_at = now() WHERE id = ANY($1::uuid[])"


async def relay(dsn: str, nats_url: str, subject: str, batch: int, idle: float) -> None:
    """Drain the hand outbox into JetStream until SIGTERM."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    conn = await asyncpg.connect(dsn)
    # As the router's bookkeeping: a mark lost in a crash only sends its rows again.
    await conn.execute("SET synchronous_commit = off")
    client = await nats.connect(nats_url)
    acks, inbox = Acks(), client.new_inbox()
    await client.subscribe(inbox, cb=acks.on_reply)
    try:
        while not stop.is_set():
            async with conn.transaction():
                rows = await conn.fetch(LOCK, batch)
                if rows:
                    done = acks.expect(len(rows))
                    for message_id, event_type, payload in rows:
                        await client.publish(
                            f"{subject}.{event_type}",
                            payload.encode(),
                            reply=inbox,
                            headers={"Nats-Msg-Id": message_id},
                        )
                    await asyncio.wait_for(done, 30)
                    await conn.execute(MARK, [row[0] for row in rows])
            if not rows:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), idle)
    finally:
        await client.close()
        await conn.close()


def main() -> None:
    """Parse, run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--nats", required=True)
    parser.add_argument("--subject", required=True, help="subjects are SUBJECT.<type>")
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--idle", type=float, default=0.01)
    args = parser.parse_args()
    uvloop.run(relay(args.dsn, args.nats, args.subject, args.batch, args.idle))


if __name__ == "__main__":
    main()
