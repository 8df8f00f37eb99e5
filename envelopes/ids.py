"""Message ids: UUIDv7 (RFC 9562), time-ordered so ids sort roughly by creation time."""

from __future__ import annotations

import os
import threading
import time
import uuid

__all__ = ["uuid7", "uuid7_text"]

_lock = threading.Lock()
_last_ms = 0
_counter = 0

# The random bits come from os.urandom, a CSPRNG as RFC 9562 asks, drawn a page at a time:
# a read of 8 bytes is a system call per id, a fifth of what an id cost. The pool is read
# under the lock, so no two ids share bytes; a forked child starts with an empty pool of its
# own, or it would repeat its parent's next ids' random bits.
_POOL_BYTES = 4096
_pool = b""
_pool_at = 0


def _empty_pool() -> None:
    global _pool, _pool_at
    _pool, _pool_at = b"", 0


os.register_at_fork(after_in_child=_empty_pool)


def uuid7() -> uuid.UUID:
    """Return a new UUIDv7; ids made in one process are strictly increasing."""
    return uuid.UUID(int=_uuid7_int())


def uuid7_text() -> str:
    """``str(uuid7())``, without the UUID object: its hex formed straight from the number
    (one per staged event, a fifth of what ``str(uuid7())`` costs)."""
    h = f"{_uuid7_int():032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _uuid7_int() -> int:
    global _last_ms, _counter, _pool, _pool_at
    with _lock:
        if _pool_at + 10 > len(_pool):
            _pool, _pool_at = os.urandom(_POOL_BYTES), 0
        at = _pool_at
        ms = time.time_ns() // 1_000_000
        if ms > _last_ms:
            _last_ms = ms
            # Start the 12-bit counter in the lower half so a burst has room to grow.
            _counter = int.from_bytes(_pool[at + 8 : at + 10]) & 0x7FF
            _pool_at = at + 10
        else:
            # Same millisecond (or the clock stepped back): keep order with the counter,
            # borrowing the next millisecond when it overflows (RFC 9562, method 1).
            _counter += 1
            if _counter > 0xFFF:
                _last_ms += 1
                _counter = 0
            _pool_at = at + 8
        ms, counter = _last_ms, _counter
        rand = int.from_bytes(_pool[at : at + 8]) & 0x3FFF_FFFF_FFFF_FFFF
    # 48 bits of milliseconds, version 7, the 12-bit counter, variant 0b10, 62 random bits.
    return (ms & 0xFFFF_FFFF_FFFF) << 80 | (0x7000 | counter) << 64 | 0b10 << 62 | rand
