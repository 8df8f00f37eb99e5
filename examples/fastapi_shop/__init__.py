"""A FastAPI shop that stages its events with ``Outbox`` (see README.md)."""
