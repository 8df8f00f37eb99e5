"""The Lua script that writes one atomic unit to Redis once, and the marker it leaves.

A unit goes as one ``EVALSHA`` (``EVAL`` when the server has not cached the script yet):

1. ``GET`` the unit's marker key. Present: the unit was stored before (its answer was lost to
   a cut connection or a killed relay, and the relay sent it again): answer the entry ids the
   marker holds, store nothing.
2. ``TYPE`` each member's key: one that holds anything but a stream refuses the unit before
   anything of it is stored (an XADD to it would fail half-way).
3. ``XADD`` each member in order (``MAXLEN ~`` as the broker says), each through
   ``redis.pcall``, so that an XADD that fails all the same (a stream whose ids are exhausted,
   no memory left) ends the script with the ids of the members stored before it: Redis does
   not roll back a script's writes.
4. ``SET`` the marker to the entry ids, expiring after ``duplicate_window_seconds``.

Redis runs a script whole, no other client's command between its commands, as it runs a
``MULTI``/``EXEC``. The marker's name is the same from every relay: a digest of the broker's
name and each member's stream and message id, under ``router:unit:`` and the hash tag of the
unit's first stream (``{tag}``, or the whole name), so that in a cluster it lives in that
stream's slot. (A unit's keys must share a slot there in any case, as a transaction's must;
only a stream name holding a ``}`` without a hash tag lands its marker elsewhere.)

The script needs, besides ``XADD``: ``EVALSHA``, ``EVAL``, ``GET``, ``SET`` and ``TYPE``, and
the keys ``router:unit:*`` (``SCRIPT_GRANTS``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import orjson
from redis.typing import EncodableT, FieldT

from brokers._protocol import OutgoingMessage

__all__ = [
    "MARKER_PREFIX",
    "SCRIPT",
    "SCRIPT_GRANTS",
    "SHA",
    "STORED",
    "STORED_BEFORE",
    "STORED_IN_PART",
    "STORED_UNMARKED",
    "WRONG_TYPE",
    "marker_key",
    "script_arguments",
]

MARKER_PREFIX = "router:unit:"
"""Where the markers live; a user's ACL must allow it (``~router:unit:*``)."""
SCRIPT_GRANTS = "+evalsha +eval +get +set +type ~router:unit:*"
"""What a Redis user needs, besides XADD on its streams, for the script."""

# The script's answer opens with one of these; the entry ids follow.
STORED = 0
"""Stored now: ``[0, id, ...]``."""
STORED_BEFORE = 1
"""Stored before, nothing stored now: ``[1, "id id ..."]`` (the marker's value)."""
WRONG_TYPE = 2
"""Nothing stored: ``[2, member (1-based), the key's type]``."""
STORED_IN_PART = 3
"""An XADD failed: ``[3, member (1-based), its error, the ids of the members before it]``."""
STORED_UNMARKED = 4
"""Stored, but the marker could not be set: ``[4, SET's error, id, ...]``."""

# KEYS: the marker, then each member's stream. ARGV: the marker's life in milliseconds,
# MAXLEN ~ ('' for none), then per member the count of its field names and values, and them.
# Each XADD takes its fields straight from ARGV (unpack with bounds): copying them into a table
# first cost the server about a fifth of the script's time (33 against 40 us for a unit of
# three, INFO commandstats).
SCRIPT = """\
local stored = redis.call('GET', KEYS[1])
if stored then
  return {1, stored}
end
for k = 2, #KEYS do
  local kind = redis.call('TYPE', KEYS[k])['ok']
  if kind ~= 'stream' and kind ~= 'none' then
    return {2, k - 1, kind}
  end
end
local ids = {}
local at = 3
for k = 2, #KEYS do
  local count = tonumber(ARGV[at])
  local id
  if ARGV[2] ~= '' then
    id = redis.pcall('XADD', KEYS[k], 'MAXLEN', '~', ARGV[2], '*', unpack(ARGV, at + 1, at + count))
  else
    id = redis.pcall('XADD', KEYS[k], '*', unpack(ARGV, at + 1, at + count))
  end
  if type(id) == 'table' and id['err'] then
    local answer = {3, k - 1, id['err']}
    for _, done in ipairs(ids) do
      answer[#answer + 1] = done
    end
    return answer
  end
  ids[#ids + 1] = id
  at = at + count + 1
end
local answer = {0}
local set = redis.pcall('SET', KEYS[1], table.concat(ids, ' '), 'PX', ARGV[1])
if type(set) == 'table' and set['err'] then
  answer = {4, set['err']}
end
for _, done in ipairs(ids) do
  answer[#answer + 1] = done
end
return answer
"""
SHA = hashlib.sha1(SCRIPT.encode()).hexdigest()  # noqa: S324 - Redis names scripts so
"""The name ``EVALSHA`` calls the script by."""


def marker_key(broker: str, unit: Sequence[OutgoingMessage]) -> str:
    """The unit's marker: the same for the same members to the same streams from any relay."""
    members = [[m.destination, m.wire.message_id] for m in unit]
    digest = hashlib.blake2b(orjson.dumps([broker, members]), digest_size=16).hexdigest()
    return f"{MARKER_PREFIX}{{{_slot_tag(unit[0].destination)}}}:{digest}"


def script_arguments(
    marker: str,
    unit: Sequence[OutgoingMessage],
    entries: Sequence[dict[FieldT, EncodableT]],
    *,
    window: float,
    maxlen: int | None,
) -> list[EncodableT]:
    """What follows the script (or its SHA) in ``EVAL``: keys, then arguments (see
    ``SCRIPT``); ``entries``: each member's fields; ``window``: the marker's life, seconds."""
    arguments: list[EncodableT] = [len(unit) + 1, marker]
    arguments += [m.destination for m in unit]
    arguments += [max(1, round(window * 1000)), "" if maxlen is None else maxlen]
    for fields in entries:
        arguments.append(2 * len(fields))
        for name, value in fields.items():
            arguments += (name, value)
    return arguments


def _slot_tag(key: str) -> str:
    """What Redis Cluster hashes of ``key``: its hash tag (``{...}``, not empty), else it all."""
    start = key.find("{")
    end = key.find("}", start + 1) if start >= 0 else -1
    return key[start + 1 : end] if end > start + 1 else key
