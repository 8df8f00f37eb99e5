"""A Flask shop that stages its events with ``SyncOutbox`` (see README.md)."""
