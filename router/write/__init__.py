"""The write path, in the application's process: events, ``Outbox.stage()`` (one row per
target in the caller's transaction) and the consumer-side ``Inbox``. Imports only the root
modules of ``router``; never ``relay`` or ``ops``."""
