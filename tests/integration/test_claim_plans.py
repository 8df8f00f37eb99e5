"""The PostgreSQL claim is index-served whatever the statistics say (migration 0008).

On an outbox without statistics, and once PL/pgSQL had settled on a generic plan, the claim
used to check each candidate's stream against an index holding every open entry of the
target, dead ones included: a claim's cost grew with every row delivered since the last
VACUUM, and a router following a steady trickle fell further behind every second. These
tests read the plans PostgreSQL actually ran (auto_explain, nested statements included)
for claims past the switch to the generic plan, before and after ANALYZE.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from decimal import Decimal

import asyncpg
import pytest

from router import Outbox
from tests.conftest import PgDatabases, make_config
from tests.integration.events import OrderPlaced

BROKERS = {"events": {"type": "memory", "internal": True}}
CLAIM = "SELECT seq FROM router_claim('events', $1, 'w', 30, true, 0)"
MARK = (
    "SELECT router_mark($1, $2, '{}', '{}', '{}', '{}', '{}', 'events', '{}', '{}',"
    " '{}', '{}', '{}', '{}')"
)
CLAIMS = 8  # PL/pgSQL plans the first five calls for their values, then may go generic


async def staged(url: str, events: int, per_stream: int) -> None:
    outbox = Outbox(make_config({"main": url}, BROKERS))
    try:
        for start in range(0, events, 500):
            async with outbox.transaction() as tx:
                # One INSERT per transaction (stream_keys), not one per stream: the same
                # rows, a tenth of the fixture's time.
                numbers = range(start, min(start + 500, events))
                await tx.stage(
                    *(OrderPlaced(order_id=f"o-{i}", total=Decimal(i)) for i in numbers),
                    stream_keys=[f"s-{i - i % per_stream}" for i in numbers],
                )
    finally:
        await outbox.close()


async def claim_plans(conn: asyncpg.Connection, batch: int, analyze: bool = False) -> list[str]:
    """Claim and mark ``CLAIMS`` batches; the plan of each claim's main statement (with
    ``analyze``, as it ran: what each node did, or that it was never executed)."""
    return [n for n in await plans(conn, batch, analyze) if "WITH picked AS" in n]


async def mark_plans(conn: asyncpg.Connection, batch: int) -> list[str]:
    """Claim and mark ``CLAIMS`` batches; the plan of each mark's published statement."""
    return [n for n in await plans(conn, batch) if "SET status = 'published'" in n]


async def plans(conn: asyncpg.Connection, batch: int, analyze: bool = False) -> list[str]:
    """Claim and mark ``CLAIMS`` batches (each row with a receipt); every plan ran."""
    notices: list[str] = []
    conn.add_log_listener(lambda _, message: notices.append(message.message))
    await conn.execute(
        "LOAD 'auto_explain'; SET auto_explain.log_min_duration = 0;"
        " SET auto_explain.log_nested_statements = on; SET auto_explain.log_level = notice;"
        f" SET auto_explain.log_analyze = {'on' if analyze else 'off'};"
        " SET client_min_messages = notice"
    )
    for _ in range(CLAIMS):
        async with conn.transaction():  # a batch: claim, publish (here: nothing), mark
            seqs = [r[0] for r in await conn.fetch(CLAIM, batch)]
            assert len(seqs) == batch
            receipts = [f'{{"stream":"S","seq":{seq}}}' for seq in seqs]
            await conn.execute(MARK, seqs, receipts)
    await conn.execute("SET auto_explain.log_min_duration = -1")
    return notices


@pytest.fixture(params=[False, True], ids=["no statistics", "analyzed"])
async def backlog(
    pg_databases: PgDatabases, request: pytest.FixtureRequest
) -> AsyncIterator[asyncpg.Connection]:
    """A connection to an outbox of 3,000 queued rows, three per stream, with or without
    statistics."""
    async with outbox_of(pg_databases, 3_000, analyzed=request.param) as conn:
        yield conn


@pytest.fixture(params=[False, True], ids=["no statistics", "analyzed"])
async def short_backlog(
    pg_databases: PgDatabases, request: pytest.FixtureRequest
) -> AsyncIterator[asyncpg.Connection]:
    """``backlog`` with 1,250 rows: for a plan that scans the outbox for every candidate."""
    async with outbox_of(pg_databases, 1_250, analyzed=request.param) as conn:
        yield conn


@contextlib.asynccontextmanager
async def outbox_of(
    pg_databases: PgDatabases, rows: int, *, analyzed: bool
) -> AsyncIterator[asyncpg.Connection]:
    url = await pg_databases.new()
    await staged(url, rows, per_stream=3)
    conn = await asyncpg.connect(url)
    try:
        if analyzed:
            await conn.execute("ANALYZE router_outbox")
        yield conn
    finally:
        await conn.close()


async def hold_back_a_stream(conn: asyncpg.Connection) -> None:
    """The last stream's first row failed and waits an hour to retry: its stream is held
    back, so every claim checks its candidates' streams (0013)."""
    await conn.execute(
        "UPDATE router_outbox SET status = 'failed', available_at = now() + interval '1 hour'"
        " WHERE seq = (SELECT max(seq) - 2 FROM router_outbox)"
    )


async def test_every_claim_reads_the_claim_index_and_checks_streams_in_the_stream_index(
    backlog: asyncpg.Connection,
) -> None:
    await hold_back_a_stream(backlog)
    plans = await claim_plans(backlog, batch=150)
    assert len(plans) == CLAIMS
    for plan in plans:
        assert "Seq Scan" not in plan and "Bitmap" not in plan, plan
        # The candidates, in order, from the queued rows' index; each candidate's stream
        # checked in the in-flight index, never by walking the target's claim index.
        # The queue's slots only (migration 0011), each by its own indexes.
        assert re.search(
            r"Index Scan using ix_router_outbox_claim_q\d on router_outbox_q\d o", plan
        )
        assert re.search(
            r"Index Scan using ix_router_outbox_stream_q\d on router_outbox_q\d p", plan
        )
        assert not re.search(r"ix_router_outbox_claim_q\d on router_outbox_q\d p", plan)
        assert "ix_router_outbox_due" not in plan
        assert "router_outbox_done" not in plan


async def test_a_mark_finds_its_rows_by_their_seqs_with_their_receipts(
    backlog: asyncpg.Connection,
) -> None:
    found = await mark_plans(backlog, batch=150)
    published = await backlog.fetch(
        "SELECT seq, receipt FROM router_outbox WHERE status = 'published' ORDER BY seq"
    )
    assert len(found) == CLAIMS
    for plan in found:
        # Never the whole table: the rows come from the indexes by their seqs.
        assert "Seq Scan on router_outbox" not in plan, plan
        assert re.search(r"Index Cond: \(seq = ANY", plan), plan
        # One slot read: the history and the other seven queue slots are pruned (0011), when
        # planned or when run.
        scanned = set(re.findall(r"Scan(?: using \w+)? on (router_outbox_\w+)", plan))
        assert scanned == {"router_outbox_q0"}, plan
        # Paired with the receipts by a hash of the array, never by looping over the
        # unnested array once per row (50 ms a mark on 500 rows, seen before 0009 shipped).
        assert "Nested Loop" not in plan and "Hash Join" in plan, plan
    assert len(published) == CLAIMS * 150
    assert all(r["receipt"] == f'{{"stream":"S","seq":{r["seq"]}}}' for r in published)


async def test_only_the_stream_index_can_serve_the_stream_check(
    short_backlog: asyncpg.Connection,
) -> None:
    # Each queue slot also has a unique index on seq, which a plain ``p.seq < o.seq`` lets
    # serve the check: a plan that took it (seen when a slot's statistics were from an
    # earlier lap of the ring) walked every earlier entry of the slot for each candidate,
    # dead ones too while the xmin horizon was held, and claims took 100-800 ms (0012). With
    # the stream index gone (in a transaction rolled back), what is left for the check must
    # not be that index: the row comparison leaves it nothing to search by.
    # Without the stream index each candidate's check scans the outbox: 1,250 rows, not 3,000
    # (3 s a claim there); the plan, not its cost, is what this test reads. The unit index
    # (0018, target and xid of open rows) goes too: with every plan's cost swollen by those
    # scans, the planner took it for the candidates as readily as the claim index, sorting
    # them after; with the stream index there, it never does (the test below).
    backlog = short_backlog
    await hold_back_a_stream(backlog)
    tx = backlog.transaction()
    await tx.start()
    try:
        await backlog.execute("DROP INDEX ix_router_outbox_stream")
        await backlog.execute("DROP INDEX ix_router_outbox_unit")
        plans = await claim_plans(backlog, batch=150)
    finally:
        await tx.rollback()
    assert len(plans) == CLAIMS
    for plan in plans:
        assert not re.search(r"ix_router_outbox_seq_q\d on router_outbox_q\d p", plan), plan
        assert re.search(
            r"Index Scan using ix_router_outbox_claim_q\d on router_outbox_q\d o", plan
        )


async def test_a_claim_checks_no_stream_while_none_is_held_back(
    backlog: asyncpg.Connection,
) -> None:
    # Checking each candidate's stream cost a probe of every queue slot's stream index per
    # candidate: 8,000 of the 8,568 buffers a 500-row claim read. With no row failed and
    # waiting, every check would pass, so none runs (0013): a custom plan leaves it out, a
    # generic one never executes it.
    plans = await claim_plans(backlog, batch=150, analyze=True)
    assert len(plans) == CLAIMS
    for plan in plans:
        probes = re.findall(r"Index Scan using ix_router_outbox_stream_q\d on .*", plan)
        assert all("never executed" in probe for probe in probes), plan
        assert re.search(
            r"Index Scan using ix_router_outbox_claim_q\d on router_outbox_q\d o", plan
        )
    # One row failed and not yet due: the check is back, and holds its stream's rows.
    await hold_back_a_stream(backlog)
    held = await backlog.fetch(
        "SELECT seq FROM router_outbox WHERE stream_key = (SELECT stream_key FROM router_outbox"
        " WHERE status = 'failed')"
    )
    plans = await claim_plans(backlog, batch=150, analyze=True)
    probes = [re.findall(r"Index Scan using ix_router_outbox_stream_q\d on .*", p) for p in plans]
    assert all(any("never executed" not in line for line in found) for found in probes), plans
    async with backlog.transaction():
        claimed = {r[0] for r in await backlog.fetch(CLAIM, 3_000)}
    assert claimed and not claimed & {r[0] for r in held}


async def test_a_claim_looks_up_no_streams_gaps_while_its_target_has_none(
    backlog: asyncpg.Connection,
) -> None:
    # The claim asks once whether its target has any gap marker (0016), and only then looks
    # up each claimed row's: a target without gaps pays one probe of router_gaps per claim.
    # Three rounds of claims, 100 rows each: the backlog's 3,000 rows last them.
    gap_lookup = r"Index Scan using pk_router_gaps on router_gaps g.*"
    plans = await claim_plans(backlog, batch=100, analyze=True)
    assert len(plans) == CLAIMS
    for plan in plans:
        assert all("never executed" in probe for probe in re.findall(gap_lookup, plan)), plan
    # Another target's gap changes nothing; one of this target's brings the lookups back.
    insert = (
        "INSERT INTO router_gaps (target, stream_key, seq, message_id)"
        " VALUES ($1, 's-0', 0, gen_random_uuid())"
    )
    await backlog.execute(insert, "elsewhere")
    plans = await claim_plans(backlog, batch=100, analyze=True)
    for plan in plans:
        assert all("never executed" in probe for probe in re.findall(gap_lookup, plan)), plan
    await backlog.execute(insert, "events")
    plans = await claim_plans(backlog, batch=100, analyze=True)
    for plan in plans:
        assert re.search(r"pk_router_gaps on router_gaps g .*\(actual .* loops=100\)", plan), plan


async def test_a_claim_pays_nothing_for_held_or_parked_streams_while_its_target_has_none(
    backlog: asyncpg.Connection,
) -> None:
    # Held and parked rows hold their streams back through the held-back check the claim ran
    # already (0017): with none of them, and no row failed, no stream is checked and no
    # parked row looked for; with a failed row but no parked one, the claim looks for a
    # parked row once (a probe of the stream index) and parks nothing.
    parked_probe = r"Index (?:Only )?Scan using ix_router_outbox_stream_q\d on router_outbox_q\d p"
    notices = await plans(backlog, batch=100, analyze=True)
    claims = [n for n in notices if "WITH picked AS" in n]
    assert len(claims) == CLAIMS
    assert not [n for n in notices if "Update on router_outbox_queue o" in n], notices
    looks = [n for n in notices if "p.status = 'parked'" in n]
    assert len(looks) == CLAIMS
    for look in looks:  # planned away (held back is false), or never run
        assert all("never executed" in probe for probe in re.findall(parked_probe + ".*", look))
    for plan in claims:
        probes = re.findall(r"Index Scan using ix_router_outbox_stream_q\d on .*", plan)
        assert all("never executed" in probe for probe in probes), plan

    await hold_back_a_stream(backlog)
    notices = await plans(backlog, batch=100, analyze=True)
    assert not [n for n in notices if "Update on router_outbox_queue o" in n], notices
    looks = [n for n in notices if "p.status = 'parked'" in n]
    assert len(looks) == CLAIMS
    for look in looks:
        assert re.search(parked_probe + r".*\(actual .* loops=1\)", look), look

    # A parked head: the claims park the rows they find behind it, and claim none of them.
    await backlog.execute(
        "UPDATE router_outbox SET status = 'parked' WHERE seq = (SELECT min(seq) FROM"
        " router_outbox WHERE stream_key = 's-2994' AND status = 'pending')"
    )
    await backlog.execute(
        "INSERT INTO router_outbox (message_id, target, destination, event_type, stream_key,"
        " envelope) SELECT gen_random_uuid(), target, destination, event_type, stream_key,"
        " envelope FROM router_outbox WHERE stream_key = 's-2994' LIMIT 1"
    )
    async with backlog.transaction():
        claimed = await backlog.fetch(
            "SELECT seq, stream_key FROM router_claim('events', 3000, 'w', 30, true, 0)"
        )
    assert claimed and all(r["stream_key"] != "s-2994" for r in claimed)
    behind = await backlog.fetch(
        "SELECT status FROM router_outbox WHERE stream_key = 's-2994' ORDER BY seq"
    )
    assert [r["status"] for r in behind] == ["parked"] * len(behind)


async def test_a_mark_plans_its_statements_once_not_on_every_call(
    backlog: asyncpg.Connection,
) -> None:
    # A generic plan names the function's arrays as parameters ($1); a plan made for one
    # call's values spells them out. Planning the UPDATE of the partitioned queue again on
    # every call was most of a small batch's mark (0022).
    found = await mark_plans(backlog, batch=2)
    assert len(found) == CLAIMS
    for plan in found:
        assert re.search(r"Index Cond: \(seq = ANY \(\$\d+\)\)", plan), plan


async def test_a_mark_closes_a_long_gap_by_hashing_its_ids_once(
    pg_databases: PgDatabases,
) -> None:
    # A published row that named a gap of 5,000 abandoned rows: under the generic plan (0022)
    # a test against the cast array recast all 5,000 ids for each gap row, and the mark took
    # 10 s. The ids are cast once, hashed, and joined to the rows the stream key finds.
    conn = await asyncpg.connect(await pg_databases.new())
    try:
        await conn.execute(
            "INSERT INTO router_gaps (target, stream_key, seq, message_id)"
            " SELECT 'events', 'k', n - 5000, gen_random_uuid() FROM generate_series(0, 4999) n"
        )
        ids = [r[0] for r in await conn.fetch("SELECT message_id::text FROM router_gaps")]
        notices: list[str] = []
        conn.add_log_listener(lambda _, message: notices.append(message.message))
        await conn.execute(
            "LOAD 'auto_explain'; SET auto_explain.log_min_duration = 0;"
            " SET auto_explain.log_nested_statements = on; SET auto_explain.log_level = notice;"
            " SET client_min_messages = notice"
        )
        await conn.execute(
            "SELECT router_mark('{}', '{}', '{}', '{}', '{}', '{}', '{}', 'events', $1, $2,"
            " '{}', '{}', '{}', '{}')",
            ["k"],
            ids,
        )
        await conn.execute("SET auto_explain.log_min_duration = -1")
        left = await conn.fetchval("SELECT count(*) FROM router_gaps")
    finally:
        await conn.close()
    [plan] = [n for n in notices if "DELETE FROM router_gaps" in n]
    assert "Hash Join" in plan and "Hash Cond: (g.message_id = r.message_id)" in plan, plan
    assert "uuid[]" not in plan[plan.index("Delete on") :], plan  # no cast left for each row
    assert left == 0
