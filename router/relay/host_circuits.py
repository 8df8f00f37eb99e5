"""One circuit per host and target: what one worker learns about its path to a broker, the
other workers of the same ``router serve --workers N`` know at once.

A host cut off from a broker is cut off for all its workers. Without this, each worker found
the cut by its own publish: when the second one claimed the target after the first gave its
rows back, it held them for one more detection time (half a second on a quick broker, about
two on Service Bus), and on PostgreSQL held the whole target with them.

The parent maps a small file into every worker (``ROUTER_HOST_CIRCUITS`` names it): a header
naming the targets, then one 8-byte word per target, ``generation << 1 | open``. A worker's
``Circuit`` writes its word when it opens or closes, and reads it (a memory read, no system
call) each time the processor asks whether to claim: a sibling's opening opens it too, and
probes on its own schedule; a sibling's probe that got through closes it, on trial like its
own (``router.relay.circuit``). Writes take the file's lock so that generations never repeat;
reads take none, and an 8-byte aligned word is read whole.

Nothing here is a verdict on a row, and nothing outlives the parent: a worker that reads a
stale word at worst probes once more, or claims once and finds the cut itself.
"""

from __future__ import annotations

import fcntl
import json
import logging
import mmap
import os
import struct
from collections.abc import Iterable

__all__ = ["ENVIRONMENT", "HostCircuits", "SharedWord"]

ENVIRONMENT = "ROUTER_HOST_CIRCUITS"
log = logging.getLogger(__name__)

_WORD = struct.Struct("<q")
_LENGTH = struct.Struct("<I")


class SharedWord:
    """One target's word in the host's file: its circuit as the host's workers last set it."""

    def __init__(self, circuits: HostCircuits, offset: int) -> None:
        self._circuits = circuits
        self._offset = offset

    def read(self) -> tuple[int, bool]:
        """(generation, open) as last written."""
        word: int = _WORD.unpack_from(self._circuits.memory, self._offset)[0]
        return word >> 1, bool(word & 1)

    def write(self, opened: bool) -> int:
        """Set open or closed for every worker of the host; returns the new generation."""
        with self._circuits.locked():
            generation, _ = self.read()
            generation += 1
            _WORD.pack_into(self._circuits.memory, self._offset, generation << 1 | opened)
        return generation


class HostCircuits:
    """The file every worker of one ``router serve`` maps: one word per target."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR)
        try:
            self.memory = mmap.mmap(self._fd, 0)
        except BaseException:
            os.close(self._fd)
            raise
        (length,) = _LENGTH.unpack_from(self.memory, 0)
        names: list[str] = json.loads(bytes(self.memory[_LENGTH.size : _LENGTH.size + length]))
        start = _aligned(_LENGTH.size + length)
        self._offsets = {name: start + _WORD.size * i for i, name in enumerate(names)}

    @classmethod
    def create(cls, path: str, targets: Iterable[str]) -> None:
        """Write a fresh file naming ``targets`` (``database/target``), every circuit closed."""
        header = json.dumps(sorted(set(targets))).encode()
        names = len(json.loads(header))
        size = _aligned(_LENGTH.size + len(header)) + _WORD.size * names
        with open(path, "wb") as file:
            file.write(_LENGTH.pack(len(header)) + header)
            file.truncate(max(size, 1))

    @classmethod
    def from_environment(cls) -> HostCircuits | None:
        """The parent's file, in a worker of ``router serve --workers N``; else None (also
        when the file is gone: each worker then keeps its own circuits, as a lone serve)."""
        path = os.environ.get(ENVIRONMENT)
        if not path:
            return None
        try:
            return cls(path)
        except (OSError, ValueError) as exc:
            log.warning("circuits.unshared", extra={"path": path, "error": str(exc)})
            return None

    def word(self, database: str, target: str) -> SharedWord | None:
        """The target's word; None for a target the parent's config did not name."""
        offset = self._offsets.get(f"{database}/{target}")
        return None if offset is None else SharedWord(self, offset)

    def locked(self) -> _Lock:
        """The file's lock, held while a word is rewritten."""
        return _Lock(self._fd)

    def close(self) -> None:
        """Unmap and close the file."""
        self.memory.close()
        os.close(self._fd)


class _Lock:
    def __init__(self, fd: int) -> None:
        self._fd = fd

    def __enter__(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *_: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)


def _aligned(offset: int) -> int:
    return -(-offset // _WORD.size) * _WORD.size
