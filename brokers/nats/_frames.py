"""A window of JetStream publishes written as one block of NATS protocol frames.

nats-py's ``Client.publish`` builds every HPUB frame with a regular expression per header
name and queues it for its flusher on its own: about half of the CPU a message costs the
adapter (py-spy, 20,000-event drain). Here each frame is one format operation (header names
are checked once and remembered; values lose CR and LF, as nats-py does), and a window of
frames goes to the client's write queue in one piece.

That write queue (``Client._send_command`` and ``_flush_pending``) is not nats-py's public
API. Where a version lacks it, ``FRAMES`` is False and the adapter sends each message with
``Client.publish`` instead, after the same checks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nats.aio.client import Client
from nats.errors import ConnectionClosedError

from brokers.nats._settings import HEADER_NAME

__all__ = ["FRAMES", "Refused", "frame", "send"]

FRAMES = callable(getattr(Client, "_send_command", None)) and callable(
    getattr(Client, "_flush_pending", None)
)

_NO_NEWLINES = str.maketrans({"\r": " ", "\n": " "})
_checked: set[str] = set()
_CHECKED_AT_MOST = 1024  # names an application makes up per message are checked every time


class Refused(ValueError):
    """This message cannot be sent as it is (a header name, or its size)."""


def frame(
    subject: str, reply: str, headers: Mapping[str, str], body: bytes, max_payload: int
) -> bytes:
    """The HPUB frame of one message (raises ``Refused``)."""
    lines = ["NATS/1.0\r\n"]
    for name, value in headers.items():
        if name not in _checked:
            if not HEADER_NAME.fullmatch(name):
                raise Refused(f"header name {name!r} is not allowed by NATS")
            if len(_checked) < _CHECKED_AT_MOST:
                _checked.add(name)
        if "\r" in value or "\n" in value:
            value = value.translate(_NO_NEWLINES)
        lines.append(f"{name}: {value}\r\n")
    lines.append("\r\n")
    head = "".join(lines).encode()
    size = len(head) + len(body)
    if size > max_payload:
        raise Refused(f"message too large: {size:,} bytes, the server takes {max_payload:,}")
    return b"HPUB %s %s%d %d\r\n%s%s\r\n" % (
        subject.encode(),
        (reply + " ").encode() if reply else b"",
        len(head),
        size,
        head,
        body,
    )


async def send(client: Any, frames: list[bytes]) -> None:
    """Queue the frames in order and have the client's flusher write them."""
    if not client.is_connected:  # queued frames would wait for a reconnect that never comes
        raise ConnectionClosedError
    await client._send_command(b"".join(frames))
    await client._flush_pending()
