"""startup: how long ``router serve`` takes from its process start to its first publish.

    python -m bench.startup [--rounds 7] [--events 100]

Each start gets a fresh migrated PostgreSQL database holding ``--events`` pending events
(staged before the start) and a fresh file-storage JetStream stream, which the router only
checks (``stream.create`` left on, as users run it). The config is NATS-only with no embedded
server: NATS is already running. Cases alternate, ``--workers 1`` then ``--workers 2``, for
``--rounds`` rounds (after one uncounted warm-up start of each), so drift on the shared machine
hits both alike. Per start, in ms after exec:

- exec: the bench's wall clock read just before the process is spawned. /proc/<pid>/stat's
  start time is kept in the JSON as a cross-check, but it counts 10 ms clock ticks;
- imported: when ``router.cli.main`` finished importing. The process runs the console script's
  own two lines (import ``main``, call it) with a clock read between them, written to a file;
  the router's code is unchanged;
- workers forked (``--workers 2``): when the last worker process was forked, from /proc;
- claiming: when the first processor started (its ``processor.started`` log line, logged as
  its loop begins, just before its first claim);
- worker ready (``--workers 2``): each worker's own start to ready (it has started its
  processors), from the parent's ``worker.ready`` lines: workers are forked from the pool's
  pre-imported fork server, so this is the time a restarted worker needs too;
- first / all: when JetStream stored the first and the last of the events (the server's
  timestamps on the stored messages, same machine, same wall clock).

The router runs as pip installs it: with its modules' bytecode compiled (the bench compiles
the tree first; a checkout run with ``PYTHONDONTWRITEBYTECODE=1`` would compile every module
at every start, a cost users do not pay).

Figures are the median and the min-max of the rounds. Then what importing costs: the wall
time of ``python -c "import router.cli.main"`` against ``python -c pass`` and against the same
import ending in ``os._exit(0)`` (no interpreter teardown), fresh processes taking turns; and
the modules (with their importer) and packages that cost the most under
``python -X importtime`` (median over as many runs). Every router process group is killed,
every database and stream dropped, also on failure.
"""

from __future__ import annotations

import argparse
import asyncio
import compileall
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
import yaml
from nats.js.api import StorageType

from bench._common import (
    ROOT,
    Stream,
    fresh_database,
    fresh_stream,
    median,
    order,
    print_table,
    router_config,
    wait_for_count,
    write_results,
)
from router import Outbox
from router.config import RouterConfig
from router.serve.forkserver import worker_pids

# The body of the `router` console script, with a clock read once the CLI is imported.
WRAPPER = """import sys, time
from router.cli.main import main
with open(sys.argv[1], "w") as f:
    f.write(repr(time.time()))
sys.exit(main(sys.argv[2:]))
"""
CLK_TCK = os.sysconf("SC_CLK_TCK")
PER_ORDER = 4
CASES = (1, 2)
STARTS = ("imported", "workers_forked", "claiming", "worker_ready", "first", "all", "proc_start")


async def stage(url: str, config: dict[str, Any], events: int) -> None:
    """``events`` pending events in one transaction, four per stream key."""
    outbox = Outbox(RouterConfig.model_validate(config).with_base_dir(Path.cwd()))
    conn = await asyncpg.connect(url)
    try:
        async with conn.transaction():
            await outbox.stage(
                conn,
                *(order(i) for i in range(events)),
                stream_keys=[f"order-{i // PER_ORDER}" for i in range(events)],
            )
    finally:
        await conn.close()
        await outbox.close()


def started_at(pid: int) -> float:
    """A process's start (fork) time as wall-clock epoch seconds, from /proc (10 ms ticks)."""
    ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    booted = time.time() - float(Path("/proc/uptime").read_text().split()[0])
    return booted + ticks / CLK_TCK


class StartedRouter:
    """``router serve`` in its own process group; the whole group is killed on exit."""

    def __init__(self, config: dict[str, Any], workers: int) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="router-startup-"))
        (self.folder / "config.yaml").write_text(yaml.safe_dump(config))
        self.log = (self.folder / "router.log").open("w")
        argv = ["--log-level", "info", "--log-format", "json", "serve", "--workers", str(workers)]
        self.exec_at = time.time()
        self.process = subprocess.Popen(
            [sys.executable, "-c", WRAPPER, str(self.folder / "imported"), *argv],
            cwd=self.folder,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def imported_at(self) -> float:
        """When the CLI module had finished importing."""
        return float((self.folder / "imported").read_text())

    def log_events(self, name: str) -> list[dict[str, Any]]:
        """The router's JSON log lines of one event."""
        self.log.flush()
        lines = (self.folder / "router.log").read_text().splitlines()
        records = [json.loads(line) for line in lines if line.startswith("{")]
        return [r for r in records if r.get("event") == name]

    def log_tail(self) -> str:
        """The end of the router's output, for an error message."""
        self.log.flush()
        return "\n".join((self.folder / "router.log").read_text().splitlines()[-20:])

    def __enter__(self) -> StartedRouter:
        return self

    def __exit__(self, *exc: object) -> None:
        """SIGTERM to the group, then SIGKILL to whatever is left of it."""
        group = self.process.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
        self.process.wait()
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)


async def await_stream(router: StartedRouter, stream: Stream, events: int) -> tuple[float, float]:
    """The stored times of the first and last event; fails at once if the router exits."""
    waiting = asyncio.create_task(wait_for_count(stream, events, timeout=120))
    while not waiting.done():
        if router.process.poll() is not None:
            waiting.cancel()
            raise RuntimeError(
                f"router exited with {router.process.returncode}:\n{router.log_tail()}"
            )
        await asyncio.wait({waiting}, timeout=0.2)
    return waiting.result()


async def one_start(workers: int, events: int) -> dict[str, float | None]:
    """Start ``router serve --workers N`` on a fresh backlog; ms from exec to each milestone."""
    async with (
        fresh_database("startup") as url,
        fresh_stream("startup", StorageType.FILE) as stream,
    ):
        config = router_config(url, stream, create=True)
        await stage(url, config, events)
        with StartedRouter(config, workers) as router:
            first, last = await await_stream(router, stream, events)
            forked = [started_at(pid) for pid in worker_pids(router.process.pid)]
            proc_start = started_at(router.process.pid)
            imported = router.imported_at()
            claiming = min(_at(r) for r in router.log_events("processor.started"))
            ready = [r["seconds"] * 1000 for r in router.log_events("worker.ready")]

    def ms(moment: float) -> float:
        return round((moment - router.exec_at) * 1000, 1)

    return {
        "imported": ms(imported),
        "workers_forked": ms(max(forked)) if workers > 1 and forked else None,
        "claiming": ms(claiming),
        "worker_ready": round(max(ready), 1) if ready else None,
        "first": ms(first),
        "all": ms(last),
        "proc_start": ms(proc_start),
    }


def _at(record: dict[str, Any]) -> float:
    return datetime.fromisoformat(record["time"]).timestamp()


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and the runs, in ms."""
    return {
        "median": round(median(values), 1),
        "min": min(values),
        "max": max(values),
        "runs": list(values),
    }


def cell(figure: dict[str, Any] | None) -> str:
    """``median (min-max)`` for the table."""
    if figure is None:
        return "-"
    return f"{figure['median']:,.0f} ({figure['min']:,.0f}-{figure['max']:,.0f})"


async def measure_starts(rounds: int, events: int) -> dict[str, Any]:
    """One warm-up start per case, then ``rounds`` interleaved rounds; figures per case."""
    for workers in CASES:
        await one_start(workers, events)
    runs: dict[int, list[dict[str, float | None]]] = {w: [] for w in CASES}
    for round_ in range(rounds):
        for workers in CASES:
            runs[workers].append(await one_start(workers, events))
        print(
            f"round {round_ + 1}/{rounds}: "
            + ", ".join(f"--workers {w} first {runs[w][-1]['first']:,.0f} ms" for w in CASES),
            flush=True,
        )
    figures: dict[str, Any] = {}
    for workers, starts in runs.items():
        figures[f"workers {workers}"] = {
            key: spread([v for s in starts if (v := s[key]) is not None])
            if any(s[key] is not None for s in starts)
            else None
            for key in STARTS
        }
    return figures


def wall_ms(code: str) -> float:
    """Wall time of a fresh ``python -c code``, in ms."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    return round((time.perf_counter() - started) * 1000, 1)


def import_times() -> dict[str, tuple[float, float, str]]:
    """One ``python -X importtime`` run: module -> (self ms, cumulative ms, imported by)."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import router.cli.main"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    lines = [
        line.removeprefix("import time:").split("|")
        for line in out.stderr.splitlines()
        if line.startswith("import time:") and "[us]" not in line
    ]
    # A module is printed after everything it imported: its importer is the next line one
    # level up, so reading backwards the importer is the last line seen at that level.
    # A package can be listed twice: loaded where it was first needed, and again, with next
    # to no time of its own, around the parent import of the submodule that was asked for.
    modules: dict[str, tuple[float, float, str]] = {}
    seen = ["(the command)"]
    for own, total, name in reversed(lines):
        depth = (len(name) - len(name.lstrip()) - 1) // 2
        del seen[depth + 1 :]
        entry = (int(own) / 1000, int(total) / 1000, seen[depth])
        if (earlier := modules.get(name.strip())) is not None:
            entry = (entry[0] + earlier[0], *max(entry[1:], earlier[1:]))
        modules[name.strip()] = entry
        seen.append(name.strip())
    return modules


def measure_imports(rounds: int, top: int = 10) -> dict[str, Any]:
    """Interpreter start vs importing the CLI, and where the import time goes."""
    # os._exit skips the interpreter's teardown of every module, which costs a few 100 ms.
    codes = ["pass", "import router.cli.main", "import router.cli.main, os; os._exit(0)"]
    walls: dict[str, list[float]] = {code: [] for code in codes}
    for _ in range(rounds):
        for code in codes:
            walls[code].append(wall_ms(code))
    runs = [import_times() for _ in range(rounds)]
    common = set.intersection(*(set(r) for r in runs))
    modules: dict[str, dict[str, Any]] = {
        name: {
            "self_ms": round(median([r[name][0] for r in runs]), 1),
            "cumulative_ms": round(median([r[name][1] for r in runs]), 1),
            "imported_by": runs[0][name][2],
        }
        for name in common
    }
    packages: dict[str, float] = {}
    for name, figure in modules.items():
        root = name.split(".")[0]
        packages[root] = packages.get(root, 0.0) + figure["self_ms"]
    return {
        "wall_ms": {name: spread(values) for name, values in walls.items()},
        "importtime_total_ms": round(sum(m["self_ms"] for m in modules.values()), 1),
        "top_modules_cumulative": [
            {"module": name, **modules[name]}
            for name in sorted(modules, key=lambda n: -modules[n]["cumulative_ms"])[:top]
        ],
        "top_packages_self": [
            {"package": name, "self_ms": round(packages[name], 1)}
            for name in sorted(packages, key=lambda n: -packages[n])[:top]
        ],
    }


def print_tables(rounds: int, events: int, starts: dict[str, Any], imports: dict[str, Any]) -> None:
    """The start-up table and the import tables."""
    print_table(
        f"startup: router serve, {events} pending events, NATS-only, file stream; "
        f"ms after exec, median (min-max) of {rounds}",
        [
            "case",
            "imported",
            "workers forked",
            "claiming",
            "worker ready*",
            "first publish",
            f"all {events}",
        ],
        [
            (
                f"--workers {name.split()[1]}",
                *(cell(f[k]) for k in STARTS[:-1]),
            )
            for name, f in starts.items()
        ],
    )
    print("* the slowest worker, ms from its own start (fork) to ready, not after exec")
    print_table(
        f"import: fresh processes, wall ms, median (min-max) of {rounds}",
        ["python -c", "wall ms"],
        [(code, cell(figure)) for code, figure in imports["wall_ms"].items()],
    )
    print_table(
        f"python -X importtime -c 'import router.cli.main': top 10 by cumulative "
        f"(all imports {imports['importtime_total_ms']:,.0f} ms)",
        ["module", "cumulative ms", "self ms", "imported by"],
        [
            (m["module"], f"{m['cumulative_ms']:,.1f}", f"{m['self_ms']:,.1f}", m["imported_by"])
            for m in imports["top_modules_cumulative"]
        ],
    )
    print_table(
        "the same, self time summed per top-level package",
        ["package", "self ms"],
        [(p["package"], f"{p['self_ms']:,.1f}") for p in imports["top_packages_self"]],
    )


async def main() -> None:
    """Measure imports, then the starts; print and save."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--events", type=int, default=100)
    args = parser.parse_args()
    # As pip installs it: bytecode compiled, so no start compiles a module (see the top).
    for package in ("router", "brokers", "envelopes"):
        compileall.compile_dir(ROOT / package, quiet=1)
    load_before = os.getloadavg()
    imports = measure_imports(args.rounds)
    starts = await measure_starts(args.rounds, args.events)
    # The machine is shared: the load says how much of the spread was other people's work.
    load = {"before": load_before, "after": os.getloadavg(), "cpus": os.cpu_count()}
    print_tables(args.rounds, args.events, starts, imports)
    path = write_results(
        "startup",
        {"rounds": args.rounds, "events": args.events, "workers": list(CASES), "storage": "file"},
        {"starts_ms_after_exec": starts, "imports": imports, "load_average": load},
    )
    print(f"written to {path.relative_to(path.parents[2])}")


if __name__ == "__main__":
    asyncio.run(main())
