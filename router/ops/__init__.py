"""Running and operating the router: ``router serve`` (supervisor, worker pool, embedded
servers, the HTTP console), the CLI, the operations commands, ``check`` and migrations.
The top of the flow: it may import ``write`` and ``relay``; nothing below imports it."""
