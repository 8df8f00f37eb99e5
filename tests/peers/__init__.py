"""Peers the tests start: brokers the machine does not run (tansu for Kafka, a Service Bus
peer)."""

from __future__ import annotations

import subprocess
from typing import Any


def end(process: subprocess.Popen[Any] | None) -> None:
    """Stop a peer's process: SIGTERM, then SIGKILL after 5 s."""
    if process is not None and process.poll() is None:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
