"""Poison events, and the operator who lets their stream keys go (``--poison N``).

A poison event is padded past the stream's ``max_msg_size``, which the run sets when it
creates the stream: JetStream refuses it for good (error 400), so the target's ordering keeps
its stream key waiting, the head ``held`` (``hold``) or parked with every later row of its
key (``park``). Each poison event is on a stream of its own, and they are spread over the
first half of the run (``poison_slots``).

Once all are committed, ``Operator`` does what an operator would: polls ``router held
--json`` until every poisoned key is listed, raises the stream's ``max_msg_size``
(``update_stream``) and runs ``router release TARGET KEY`` for each. The keys are then
delivered in order, head first, which the ledger checks with every other stream.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import nats

from tests.chaos.report import Report

__all__ = ["MAX_MSG_SIZE", "PAD", "Operator", "poison_slots"]

MAX_MSG_SIZE = 8192
"""The stream's ``max_msg_size`` while the poison waits; a tick's message is under 1 KiB."""
PAD = 2 * MAX_MSG_SIZE
"""Characters a poison event carries on top of a tick: over the limit, under the router's
``outbox.max_payload_bytes`` and the server's ``max_payload``."""
# How long the operator waits for the poisoned keys to be listed, and for each step to work
# (the broker or the database may be down for a few seconds at that moment).
STOPPED_WITHIN = 60.0
STEP_WITHIN = 60.0
POLL_EVERY = 1.0  # each poll starts a router process, on a machine the run keeps busy


def poison_slots(poison: int, shares: list[int]) -> list[set[int]]:
    """For each producer (``shares``: its event count), the indexes of its events, in its
    commit order, to make poison: the i-th of ``poison`` at (i + 0.5) / poison of the
    first half of its share, the producers taking turns, so they spread over the run's first
    half as the producers commit side by side."""
    slots: list[set[int]] = [set() for _ in shares]
    for i in range(poison):
        p = i % len(shares)
        index = int(shares[p] * 0.5 * (i + 0.5) / poison)
        while index in slots[p]:
            index += 1
        slots[p].add(index)
    return slots


@dataclass
class Operator:
    """Releases the poisoned keys of ``target`` as an operator would, with the ``router``
    command run in ``folder`` (its config) and NATS at ``nats_url``; fills the report's hold
    figures."""

    router: str
    folder: Path
    nats_url: str
    stream: str
    target: str
    report: Report
    first_hold: float = 0.0
    """When the first poisoned head was given up on (epoch seconds, its ``since``)."""

    async def run(self, keys: set[str]) -> None:
        """Wait for ``keys`` to be listed held or parked, raise the limit, release each."""
        listed = await self._wait_until_stopped(keys)
        await self._raise_limit()
        self.first_hold = min(_epoch(k["since"]) for k in listed if k["stream_key"] in keys)
        for key in sorted(keys):
            await self._release(key)
        self.report.hold_to_release_seconds = round(time.time() - self.first_hold, 3)

    async def _wait_until_stopped(self, keys: set[str]) -> list[dict[str, Any]]:
        deadline = time.monotonic() + STOPPED_WITHIN
        while True:
            listed = await self._held()
            if listed is not None:
                self._note(listed)
                if keys <= {k["stream_key"] for k in listed}:
                    return listed
            if time.monotonic() > deadline:
                raise RuntimeError(f"router held did not list {sorted(keys)}: {listed}")
            await asyncio.sleep(POLL_EVERY)

    def _note(self, listed: list[dict[str, Any]]) -> None:
        report = self.report
        report.keys_stopped = max(report.keys_stopped, len(listed))
        report.rows_behind = max(report.rows_behind, sum(int(k["behind"]) for k in listed))
        report.stopped_as = sorted({*report.stopped_as, *(str(k["status"]) for k in listed)})

    async def _held(self) -> list[dict[str, Any]] | None:
        """The keys ``router held`` lists on the target; None if it failed (the database
        restarting)."""
        result = await self._router("held", self.target, "--json")
        if result.returncode != 0:
            return None
        keys: list[dict[str, Any]] = json.loads(result.stdout)["keys"]
        return keys

    async def _raise_limit(self) -> None:
        """The stream takes messages of any size again (``max_msg_size`` -1)."""
        deadline = time.monotonic() + STEP_WITHIN
        while True:
            try:
                client = await nats.connect(self.nats_url, allow_reconnect=False)
                try:
                    js = client.jetstream()
                    info = await js.stream_info(self.stream)
                    await js.update_stream(info.config, max_msg_size=-1)
                    return
                finally:
                    await client.close()
            except Exception:  # the server restarting: try again
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)

    async def _release(self, key: str) -> None:
        """``router release TARGET KEY``, again until it works; a key no longer listed (a
        database crash lost its mark, and the relay sent its head since) needs none."""
        deadline = time.monotonic() + STEP_WITHIN
        while True:
            result = await self._router("release", self.target, key, "--reason", "chaos")
            if result.returncode == 0:
                self.report.releases += 1
                return
            listed = await self._held()
            if listed is not None and key not in {k["stream_key"] for k in listed}:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"router release {key} failed: {result.stderr}")
            await asyncio.sleep(0.5)

    async def _router(self, *args: str) -> subprocess.CompletedProcess[str]:
        return await asyncio.to_thread(
            subprocess.run,
            [self.router, *args],
            cwd=self.folder,
            capture_output=True,
            text=True,
            check=False,
        )


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()
