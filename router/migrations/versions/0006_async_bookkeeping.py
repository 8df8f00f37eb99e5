"""The router's own bookkeeping may commit without waiting for the WAL flush.

- ``router_claim()`` takes ``p_async``: when true it sets ``synchronous_commit = off`` for its
  own transaction;
- ``router_mark()`` writes a batch's outcomes (published, failed with its delay, abandoned,
  untried) in one call, fenced by the claim's token, with the same ``p_async``.

The router passes ``p_async = NOT outbox.durable_bookkeeping`` (off by default).

Why it is safe: only the router's claims and marks commit asynchronously, never a row an
application stages. If PostgreSQL crashes, it may forget the last few of them (WAL keeps
them in order, so what is lost is always the most recent ones): a forgotten claim leaves its
rows pending, a forgotten mark leaves its rows leased until the lease ends. Either way the
rows are delivered again (at least once; brokers drop repeats by message id), in order. What
it saves: every claim and every mark waited for an fsync, which on a commodity disk is the
larger part of the commit-to-broker latency.

``set_config(..., true)`` lasts until the end of the calling transaction only, so a pooled
session (PgBouncer, say) never carries the setting over to an application.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23
"""

from __future__ import annotations

import importlib

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

# 0005's claim function, with a place for the new parameter and the statement that uses it
# (migrations are history: this one keeps 0005's text rather than a copy that could drift).
_previous = importlib.import_module("router.migrations.versions.0005_fast_claims")
_INDENT = " " * 40  # the parameter list's
CLAIM_FUNCTION = _previous.CLAIM_FUNCTION.replace(
    "p_token bigint)\n", f"p_token bigint\n{_INDENT}{{async_parameter}})\n"
).replace("BEGIN\n", "BEGIN\n{async_commit}\n", 1)

ASYNC_PARAMETER = ", p_async boolean"
ASYNC_COMMIT = """
    -- A lost claim only leaves its rows pending: no need to wait for the WAL flush.
    IF p_async THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
"""

MARK_FUNCTION = """
CREATE OR REPLACE FUNCTION router_mark(p_token bigint,
                                       p_published bigint[],
                                       p_failed bigint[], p_delays double precision[],
                                       p_failed_errors text[],
                                       p_abandoned bigint[], p_abandoned_errors text[],
                                       p_untried bigint[], p_async boolean)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    -- A lost mark only means its rows are delivered again once their lease ends.
    IF p_async THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    IF cardinality(p_published) > 0 THEN
        UPDATE router_outbox
        SET status = 'published', published_at = now(), last_error = NULL,
            locked_by = NULL, locked_until = NULL
        WHERE seq = ANY(p_published) AND lease_token = p_token AND status = 'processing';
    END IF;
    IF cardinality(p_failed) > 0 THEN
        UPDATE router_outbox AS o
        SET status = 'failed', available_at = now() + make_interval(secs => t.delay),
            last_error = t.error, locked_by = NULL, locked_until = NULL
        FROM unnest(p_failed, p_delays, p_failed_errors) AS t(seq, delay, error)
        WHERE o.seq = t.seq AND o.lease_token = p_token AND o.status = 'processing';
    END IF;
    IF cardinality(p_abandoned) > 0 THEN
        UPDATE router_outbox AS o
        SET status = 'abandoned', last_error = t.error, locked_by = NULL, locked_until = NULL
        FROM unnest(p_abandoned, p_abandoned_errors) AS t(seq, error)
        WHERE o.seq = t.seq AND o.lease_token = p_token AND o.status = 'processing';
    END IF;
    IF cardinality(p_untried) > 0 THEN
        -- Claimed but not sent: back in the queue, and the attempt does not count.
        UPDATE router_outbox
        SET status = CASE WHEN attempts > 1 THEN 'failed' ELSE 'pending' END,
            attempts = attempts - 1, available_at = now(), locked_by = NULL,
            locked_until = NULL
        WHERE seq = ANY(p_untried) AND lease_token = p_token AND status = 'processing';
    END IF;
END
$$
"""

MARK_SIGNATURE = (
    "router_mark(bigint, bigint[], bigint[], double precision[], text[], bigint[], text[], "
    "bigint[], boolean)"
)
CLAIM_ARGUMENTS = "text, integer, text, double precision, bigint"


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        # A new argument makes a new function: drop 0005's, or calls would be ambiguous.
        op.execute(f"DROP FUNCTION router_claim({CLAIM_ARGUMENTS})")
        op.execute(
            CLAIM_FUNCTION.replace("{async_parameter}", ASYNC_PARAMETER).replace(
                "{async_commit}\n", ASYNC_COMMIT.lstrip("\n")
            )
        )
        op.execute(MARK_FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION {MARK_SIGNATURE}")
        op.execute(f"DROP FUNCTION router_claim({CLAIM_ARGUMENTS}, boolean)")
        # 0005's claim
        op.execute(CLAIM_FUNCTION.replace("{async_parameter}", "").replace("{async_commit}\n", ""))
