"""Operator queries on the outbox: status and flow, trace, requeue, pause, cleanup, failure
groups, the message browser, replay, the audit trail, preview and the partner contract, and
the migrations (``init-db``). Each opens its own connections (``router.ops.connections``) and
runs on PostgreSQL, SQLite and MySQL/MariaDB alike.

Layer: above ``write`` and ``relay``, which it may import; ``serve`` and ``cli`` use it.
"""
