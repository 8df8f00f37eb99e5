"""A ``redis-server`` of a test's own, on a free port, with ACL users of its own: for the
refusals Redis makes when a command is queued (a key the user may not write), which the shared
server is never reconfigured for."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence

import pytest

from tests.peers import end
from tests.services import free_port, in_ci, program, reachable


@contextlib.contextmanager
def private_redis(users: Sequence[tuple[str, ...]], keys: str | Sequence[str]) -> Iterator[int]:
    """A private redis-server whose users (each ``(name, *commands)``, with no password) may
    touch the keys matching ``keys`` (a pattern or several), ping and set their client name,
    besides their commands; its port. The default user may do anything (the tests read back
    with it)."""
    patterns = [keys] if isinstance(keys, str) else list(keys)
    binary = program("redis-server")
    if binary is None:
        message = "redis-server is not installed (apt-get install redis-server)"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)
    port = free_port()
    folder = tempfile.mkdtemp(prefix="router-redis-")
    arguments = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    arguments += ["--appendonly", "no", "--dir", folder]
    for name, *commands in users:
        arguments += ["--user", name, "on", "nopass", *(f"~{k}" for k in patterns)]
        arguments += ["+ping", "+client"]
        arguments += commands
    process = subprocess.Popen(arguments, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not reachable("127.0.0.1", port, timeout=0.2):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"a private redis-server did not start on {port}")
            time.sleep(0.05)
        yield port
    finally:
        end(process)
        shutil.rmtree(folder, ignore_errors=True)
