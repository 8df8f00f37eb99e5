"""A writer in a process of its own: ``python -m tests.integration.stage_later URL GAP...``
stages one event per gap, each after that many idle seconds, through ``SyncOutbox.stage`` on
a SQLAlchemy connection (PyMySQL), and prints a JSON line per commit: its order id and the
wall-clock time just after COMMIT returned. It prints ``ready`` once its imports are done, so
the gaps measure idle time, not start-up."""

from __future__ import annotations

import json
import sys
import time
from decimal import Decimal

import sqlalchemy as sa

from router import SyncOutbox
from tests.conftest import make_config
from tests.integration.events import OrderPlaced


def main(url: str, gaps: list[float]) -> None:
    """Stage one event after each gap; report each commit on stdout."""
    outbox = SyncOutbox(
        make_config({"main": url}, {"events": {"type": "memory", "internal": True}})
    )
    engine = sa.create_engine(url.replace("mysql://", "mysql+pymysql://", 1))
    with engine.connect():  # connect before the gaps: a commit costs what an app's does
        pass
    print("ready", flush=True)
    for number, gap in enumerate(gaps):
        time.sleep(gap)
        with engine.begin() as conn:
            outbox.stage(conn, OrderPlaced(order_id=f"w-{number}", total=Decimal(number)))
        committed = time.time()
        print(json.dumps({"order_id": f"w-{number}", "committed": committed}), flush=True)
    engine.dispose()


if __name__ == "__main__":
    main(sys.argv[1], [float(gap) for gap in sys.argv[2:]])
