"""What ``router serve`` runs: the ``Runner`` (one processor per target in a process, its
watchers, the retention cleanup), the ``WorkerSupervisor`` of ``--workers N`` and its fork
server, the embedded broker servers, the HTTP console, and ``router check``'s reach of every
database and broker.

Layer: above ``ops``, which it may import; only ``cli`` imports it.
"""
