"""The relay: one processor per (database, broker) claims due rows from its store, renders
and publishes them, and marks the outcome (delivery, circuit, retry, metrics). Imports only
the root modules of ``router``; never ``write`` or ``ops``."""
