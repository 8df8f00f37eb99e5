"""idle: what an idle router costs the database.

    python -m bench.idle [--seconds 120]

``router serve`` (two targets) runs against an empty outbox. PostgreSQL's own counters for
the database (``pg_stat_database``: transactions committed and rolled back; every statement
the router sends outside a transaction is one) are read at the start and the end, from a
connection to another database so the reading itself is not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import asyncpg

from bench._common import (
    ADMIN_DSN,
    RouterProcess,
    fresh_database,
    fresh_stream,
    print_table,
    router_config,
    write_results,
)


async def transactions(database: str) -> int:
    """Committed + rolled back transactions of ``database`` so far."""
    conn = await asyncpg.connect(ADMIN_DSN)
    try:
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        value = await conn.fetchval(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = $1", database
        )
    finally:
        await conn.close()
    return int(value or 0)


async def main() -> None:
    """Measure, print, save."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    args = parser.parse_args()
    async with (
        fresh_database("idle") as url,
        fresh_stream("idle") as internal,
        fresh_stream("idle2") as partner,
    ):
        database = url.rsplit("/", 1)[1]
        config = router_config(url, internal)
        config["brokers"]["partner"] = {
            **config["brokers"]["events"],
            "internal": False,
            "destination": partner.destination,
            "stream": {
                **config["brokers"]["events"]["stream"],
                "name": partner.name,
                "subjects": [partner.subject + ".>"],
            },
        }
        with RouterProcess(config):
            # Startup (connections, first claims); PostgreSQL also flushes an idle backend's
            # counters only every ~10 s, so the migration's own transactions land by now.
            await asyncio.sleep(20)
            before, started = await transactions(database), time.monotonic()
            await asyncio.sleep(args.seconds)
            after, elapsed = await transactions(database), time.monotonic() - started
    rate = (after - before) / elapsed
    print_table(
        f"idle: statements sent to PostgreSQL by an idle router (2 targets, {elapsed:.0f} s)",
        ["statements", "seconds", "per second"],
        [(after - before, f"{elapsed:.0f}", f"{rate:.4f}")],
    )
    path = write_results(
        "idle",
        {"seconds": args.seconds, "targets": 2},
        {
            "statements": after - before,
            "seconds": round(elapsed, 1),
            "statements_per_second": round(rate, 4),
        },
    )
    print(f"written to {path.relative_to(path.parents[2])}")


if __name__ == "__main__":
    asyncio.run(main())
