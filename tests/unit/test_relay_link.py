"""One owner of a broker connection in the relay: ``router/relay/link.py``.

Every other module of ``router/relay/`` reaches its broker through a ``BrokerLink``: none
calls a broker's ``connect``, ``publish``, ``ping`` or ``close`` itself, so the connection's
life (its deadline, its silence, its circuit, its reconnects) has one home.
"""

from __future__ import annotations

import ast
from pathlib import Path

RELAY = Path(__file__).resolve().parents[2] / "router" / "relay"
OWNER = RELAY / "link.py"
CONNECTION_CALLS = {"connect", "publish", "ping", "close"}


def broker_calls(source: str) -> list[str]:
    """Calls such as ``self.broker.connect()`` or ``broker.close()``: a connection method
    called on anything whose expression names a broker."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        receiver = ast.unparse(node.func.value)
        if node.func.attr in CONNECTION_CALLS and "broker" in receiver.lower():
            found.append(f"line {node.lineno}: {ast.unparse(node.func)}()")
    return found


def test_only_the_link_opens_uses_or_closes_a_broker_connection() -> None:
    offenders = {
        str(path.relative_to(RELAY)): calls
        for path in sorted(RELAY.rglob("*.py"))
        if path != OWNER and (calls := broker_calls(path.read_text()))
    }
    assert offenders == {}


def test_the_check_sees_a_broker_call() -> None:
    # The owner itself is full of them: the check finds what it looks for.
    calls = broker_calls(OWNER.read_text())
    assert any("self.broker.connect()" in call for call in calls), calls
    assert any("self.broker.close()" in call for call in calls), calls
    assert broker_calls("await self._broker.publish(batch)") == ["line 1: self._broker.publish()"]
