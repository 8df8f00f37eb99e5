"""plots: the figures of docs/performance.md, drawn from bench/results/*.json.

    python -m bench.plots [--results bench/results] [--out docs/performance] [--check]

Reads only what the benchmarks wrote; measures nothing. Every run in the JSON is a point or a
line, so the spread between runs shows; nothing is smoothed, dropped or rescaled. Each PNG has
a fixed size and resolution, no timestamp, and a ``Source`` text entry naming the matplotlib
version that drew it, so a rerun with the same version gives the same bytes.

``--check`` draws every figure into a temporary folder and exits 1 when a JSON file a figure
reads or a committed PNG is missing, or when a committed PNG drawn by this matplotlib version
is not what the JSON gives now (rerun ``python -m bench.plots``). A PNG drawn by another
version is reported and not compared: font rendering differs between versions.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.style
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator
from matplotlib.typing import LineStyleType

__all__ = ["PLOTS", "Plot", "Result", "check", "draw_all", "main"]

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
OUT = ROOT / "docs" / "performance"
DPI = 110
SOURCE = f"python -m bench.plots, matplotlib {matplotlib.__version__}"
# Only what is set here and matplotlib's defaults: a user's matplotlibrc changes nothing.
STYLE: dict[str, Any] = {
    "font.family": "DejaVu Sans",
    "font.size": 9,
    "axes.grid": True,
    "grid.color": "#dddddd",
    "grid.linewidth": 0.6,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "legend.frameon": False,
}

Json = dict[str, Any]
# Ticks of a log axis in ms: 1-2-5 steps.
MS_TICKS = [m * 10.0**e for e in range(-1, 4) for m in (1, 2, 5)]

# Relays of bench.drain: key in the JSON, label, colour (Okabe-Ito), marker.
RELAYS = (
    ("router serve --workers 1", "router serve", "#0072B2", "o"),
    ("router serve --workers 2", "router serve --workers 2", "#56B4E9", "s"),
    ("baseline", "leasing relay (bench/baseline.py)", "#E69F00", "^"),
    ("baseline, one write", "one-write relay (baseline.py --hold)", "#000000", "D"),
)
DRAIN_METRICS = (("from_exec", "from exec"), ("first_to_last", "first to last message"))
STATS = (("p50_ms", "p50", "#009E73"), ("p99_ms", "p99", "#0072B2"), ("max_ms", "max", "#D55E00"))
VARIANTS = {"autovacuum off": "#0072B2", "autovacuum on": "#E69F00"}
TRICKLE_STATS: tuple[tuple[str, str, LineStyleType, float], ...] = (
    ("p99_ms", "p99", "-", 1.0),
    ("p50_ms", "p50", ":", 1.2),
)


@dataclass(frozen=True)
class Result:
    """One results file: its name under bench/results and what it holds."""

    file: str
    data: Json

    @property
    def when(self) -> str:
        """When the benchmark wrote it, to the minute, in UTC."""
        return f"{self.data['measured_at'][:16].replace('T', ' ')} UTC"


@dataclass(frozen=True)
class Plot:
    """One PNG: its file name, the JSON files it reads and how it is drawn."""

    name: str
    sources: tuple[str, ...]
    draw: Callable[[Figure, list[Result]], None]
    size: tuple[float, float]


def load(results: Path, name: str) -> Result:
    """One results file."""
    return Result(name, json.loads((results / name).read_text()))


def thousands(value: float, _position: object) -> str:
    """A tick label with a thousands separator."""
    return f"{value:,.0f}"


def milliseconds(value: float, _position: object) -> str:
    """A log-axis tick label in ms without needless decimals."""
    return f"{value:g}"


def log_ms_axis(ax: Axes) -> None:
    """A log y axis in ms with 1-2-5 ticks, plain numbers, no minor ticks."""
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(FixedLocator(MS_TICKS))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(milliseconds))


def drain_panel(ax: Axes, result: Result) -> None:
    """One drain result: each relay's runs, from exec and first to last, medians as ticks."""
    data = result.data
    relays = [r for r in RELAYS if r[0] in data["figures"]["file"]]
    width = 0.8 / len(relays)
    for group, (metric, _label) in enumerate(DRAIN_METRICS):
        for place, (key, _name, colour, marker) in enumerate(relays):
            figure = data["figures"]["file"][key][metric]
            runs: list[float] = figure["runs"]
            centre = group + (place - (len(relays) - 1) / 2) * width
            # Runs side by side within the relay's slot, so equal values stay visible.
            xs = [centre + (i - (len(runs) - 1) / 2) * width / 8 for i in range(len(runs))]
            ax.scatter(xs, runs, s=22, color=colour, marker=marker, zorder=3)
            ax.hlines(figure["median"], centre - width / 3, centre + width / 3, color=colour)
    parameters = data["parameters"]
    ax.set_title(
        f"{parameters['events']:,} events, {parameters['rounds']} interleaved rounds\n"
        f"{result.file}, {result.when}"
    )
    ax.set_xticks(range(len(DRAIN_METRICS)), [label for _, label in DRAIN_METRICS])
    ax.set_xlim(-0.5, len(DRAIN_METRICS) - 0.5)
    ax.grid(axis="x", visible=False)
    ax.yaxis.set_major_formatter(FuncFormatter(thousands))


def draw_drain(fig: Figure, sources: list[Result]) -> None:
    """Events/s of the router and both hand-written relays, one point per run."""
    axes = fig.subplots(1, len(sources), sharey=True)
    for ax, result in zip(axes, sources, strict=True):
        drain_panel(ax, result)
    axes[0].set_ylabel("events/s (PostgreSQL → JetStream file stream)")
    axes[0].set_ylim(bottom=0)
    handles = [
        Line2D([], [], color=colour, marker=marker, linestyle="", label=label)
        for _key, label, colour, marker in RELAYS
    ]
    handles.append(Line2D([], [], color="#555555", label="median of the runs"))
    fig.legend(handles=handles, loc="lower center", ncol=3)
    fig.suptitle("Drain a backlog: one point per run; from exec includes each process's start")
    fig.subplots_adjust(left=0.08, right=0.98, top=0.82, bottom=0.2, wspace=0.08)


def worst(row: Json, targets: Sequence[str], stat: str) -> float:
    """The highest value of ``stat`` among the targets in one second."""
    return max(float(row[target][stat]) for target in targets)


def sustained_runs(sources: list[Result], rate: float) -> list[tuple[str, Json]]:
    """Every run of the multi-connection mode at ``rate``, labelled by file and place."""
    found = []
    for result in sources:
        runs = [r for r in result.data["figures"]["runs"] if r["mode"] == "multi"]
        runs = [r for r in runs if r["offered_rate"] == rate]
        for number, run in enumerate(runs, 1):
            place = f", run {number} of {len(runs)}" if len(runs) > 1 else ""
            found.append((f"{result.file}{place} ({result.when})", run))
    return found


def sustained_panel(ax: Axes, label: str, run: Json, targets: Sequence[str]) -> None:
    """Per second of one run: p50, p99 and max, each the worst of the targets."""
    seconds = run["per_second"]
    xs = [row["second"] for row in seconds]
    for stat, name, colour in STATS:
        ax.plot(xs, [worst(row, targets, stat) for row in seconds], color=colour, label=name)
    ax.axhline(50, color="#777777", linestyle="--", linewidth=0.8)
    whole = [run["targets"][t]["p99_ms"] for t in targets]
    ax.set_title(
        f"{label}\np99 over the whole run: {min(whole):g}-{max(whole):g} ms across targets",
        fontsize=9,
    )
    log_ms_axis(ax)


def draw_sustained(fig: Figure, sources: list[Result]) -> None:
    """Latency per second at 5,000 events/s to three targets, every run in the JSON."""
    parameters = sources[0].data["parameters"]
    targets: list[str] = parameters["targets"]
    runs = sustained_runs(sources, 5000.0)
    columns = 2
    axes = fig.subplots((len(runs) + columns - 1) // columns, columns, sharex=True, sharey=True)
    flat: list[Axes] = list(axes.flat)
    for ax, (label, run) in zip(flat, runs, strict=False):
        sustained_panel(ax, label, run, targets)
    for ax in flat[len(runs) :]:
        ax.set_visible(False)
    for ax in flat[-columns:]:
        ax.set_xlabel("second of the measured period (by commit time)")
    for ax in flat[::columns]:
        ax.set_ylabel("commit → stored (ms, log)")
    handles = [Line2D([], [], color=colour, label=name) for _, name, colour in STATS]
    limit = Line2D([], [], color="#777777", linestyle="--", label="50 ms (the bench's p99 limit)")
    fig.legend(handles=[*handles, limit], loc="lower center", ncol=4)
    fig.suptitle(
        f"Sustained 5,000 events/s for {parameters['seconds']:.0f} s to {len(targets)} targets "
        f"({parameters['connections']} connections x {parameters['per_transaction']} events per "
        "transaction), router serve --workers 1\nEach second: the worst of the "
        f"{len(targets)} targets; the period starts once the router has stored a warm-up event"
    )
    fig.subplots_adjust(left=0.08, right=0.98, top=0.85, bottom=0.12, hspace=0.35, wspace=0.06)


def trickle_lines(ax: Axes, data: Json) -> None:
    """Per run, p99 and p50 of each full second of the run: one line each."""
    full = data["parameters"]["seconds"]
    for run in data["figures"]:
        # The row after the last full second holds the one or two events of the run's end.
        seconds = [row for row in run["per_second"] if row["second"] < full]
        for stat, _name, style, width in TRICKLE_STATS:
            ax.plot(
                [row["second"] for row in seconds],
                [row[stat] for row in seconds],
                color=VARIANTS[run["variant"]],
                linestyle=style,
                linewidth=width,
                alpha=0.7,
            )


def draw_trickle(fig: Figure, sources: list[Result]) -> None:
    """Per-second p99 and p50 of every trickle run, from the router's start."""
    (result,) = sources
    data = result.data
    ax = fig.subplots()
    trickle_lines(ax, data)
    log_ms_axis(ax)
    ax.set_ylabel("commit → arrival at a subscriber (ms, log)")
    ax.set_xlabel("second of the run (by commit time); router serve spawned at 0")
    counts = {v: sum(r["variant"] == v for r in data["figures"]) for v in VARIANTS}
    handles = [
        Line2D([], [], color=c, label=f"{v} ({counts[v]} runs)") for v, c in VARIANTS.items()
    ]
    handles += [
        Line2D(
            [], [], color="#555555", linestyle=style, linewidth=width, label=f"{name} per second"
        )
        for _stat, name, style, width in TRICKLE_STATS
    ]
    fig.legend(handles=handles, loc="lower center", ncol=4)
    parameters = data["parameters"]
    fig.suptitle(
        f"Trickle: one connection commits {parameters['rate']:,.0f} events/s, one per "
        "transaction, durably; a fresh router serve delivers to a file stream\n"
        f"{result.file}, {result.when}; one line per run and statistic"
    )
    fig.subplots_adjust(left=0.08, right=0.98, top=0.88, bottom=0.17)


# Modes of bench.write_concurrency against hand: key in the JSON, label, colour, marker.
WRITE_MODES = (
    ("stage/hand", "stage()", "#0072B2", "o"),
    ("hand+notify/hand", "hand-written + pg_notify", "#E69F00", "^"),
)
WRITE_CLIENTS = {
    "psycopg": "psycopg 3, threads (PostgreSQL)",
    "asyncpg": "asyncpg, tasks (PostgreSQL)",
    "mysql": "SQLAlchemy + PyMySQL, threads (MariaDB)",
}


def write_panel(ax: Axes, points: Json, relay: bool) -> None:
    """One client: each mode's commits/s over hand's, every round a dot, medians joined."""
    ks = sorted(points, key=int)
    for key, label, colour, marker in WRITE_MODES:
        present = [k for k in ks if key in points[k]]
        if not present:
            continue
        for k in present:
            runs = points[k][key]["runs"]
            ax.scatter([int(k)] * len(runs), runs, color=colour, marker=marker, s=12, alpha=0.6)
        ax.plot(
            [int(k) for k in present],
            [points[k][key]["median"] for k in present],
            color=colour,
            linestyle="--" if relay else "-",
            label=label,
        )
    ax.axhline(0.9, color="#777777", linestyle=":", linewidth=1.0)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator([int(k) for k in ks]))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _p: f"{v:g}"))
    ax.xaxis.set_minor_locator(NullLocator())


def draw_writes(fig: Figure, sources: list[Result]) -> None:
    """stage() and hand + NOTIFY against a hand-written outbox, by concurrent writers: quiet,
    and with router serve on the database (dashed)."""
    quiet, relayed = sources
    clients = [c for c in WRITE_CLIENTS if c in quiet.data["figures"]]
    axes = fig.subplots(1, len(clients), sharey=True, squeeze=False)[0]
    for ax, client in zip(axes, clients, strict=True):
        write_panel(ax, quiet.data["figures"][client], relay=False)
        if client in relayed.data["figures"]:
            write_panel(ax, relayed.data["figures"][client], relay=True)
        ax.set_title(WRITE_CLIENTS[client])
        ax.set_xlabel("writers (connections committing flat out)")
    axes[0].set_ylabel("commits/s over the hand-written outbox's")
    handles = [Line2D([], [], color=c, marker=m, label=n) for _, n, c, m in WRITE_MODES]
    handles += [
        Line2D([], [], color="#555555", linestyle="--", label="router serve running (paused)"),
        Line2D([], [], color="#777777", linestyle=":", label="0.9"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=4)
    parameters = quiet.data["parameters"]
    fig.suptitle(
        "One business row and one event per transaction, commits/s over a hand-written outbox "
        f"(one prepared INSERT)\n{quiet.file}, {quiet.when}, and {relayed.file}; "
        f"{parameters['rounds']} interleaved rounds of {parameters['seconds']:g} s, a dot each"
    )
    fig.subplots_adjust(left=0.07, right=0.98, top=0.85, bottom=0.22, wspace=0.08)


PLOTS = (
    Plot("drain.png", ("drain.json", "drain-100k.json"), draw_drain, (10.0, 5.0)),
    Plot(
        "sustained-latency.png",
        ("sustained.json", "sustained-5000-repeats.json"),
        draw_sustained,
        (10.0, 6.5),
    ),
    Plot("trickle-latency.png", ("trickle.json",), draw_trickle, (10.0, 5.0)),
    Plot(
        "write-concurrency.png",
        ("write-concurrency.json", "write-concurrency-relay.json"),
        draw_writes,
        (12.0, 4.5),
    ),
)


def draw(plot: Plot, results: Path, out: Path) -> Path:
    """Draw one PNG from its JSON files."""
    sources = [load(results, name) for name in plot.sources]
    with matplotlib.style.context(STYLE, after_reset=True):
        fig = Figure(figsize=plot.size, dpi=DPI)
        FigureCanvasAgg(fig)
        plot.draw(fig, sources)
        target = out / plot.name
        fig.savefig(target, dpi=DPI, metadata={"Software": None, "Source": SOURCE})
    return target


def draw_all(results: Path, out: Path) -> list[Path]:
    """Every PNG into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    return [draw(plot, results, out) for plot in PLOTS]


def png_text(data: bytes) -> dict[str, str]:
    """The tEXt entries of a PNG."""
    entries: dict[str, str] = {}
    at = 8  # past the signature
    while at + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[at : at + 8])
        if kind == b"tEXt":
            key, _, value = data[at + 8 : at + 8 + length].partition(b"\0")
            entries[key.decode("latin-1")] = value.decode("latin-1")
        if kind == b"IEND":
            break
        at += 12 + length  # length, type, data, CRC
    return entries


def missing(results: Path, out: Path) -> list[str]:
    """The JSON files and committed PNGs that are not there."""
    paths = [results / name for plot in PLOTS for name in plot.sources]
    paths += [out / plot.name for plot in PLOTS]
    return [f"missing: {path}" for path in paths if not path.exists()]


def check(results: Path, out: Path) -> int:
    """0 when every input and PNG is there and no PNG is stale; 1 otherwise."""
    problems = missing(results, out)
    if not problems:
        with tempfile.TemporaryDirectory() as folder:
            for fresh in draw_all(results, Path(folder)):
                committed = (out / fresh.name).read_bytes()
                drawn_by = png_text(committed).get("Source", "an unknown matplotlib")
                if committed == fresh.read_bytes():
                    print(f"ok: {fresh.name}")
                elif drawn_by == SOURCE:
                    problems.append(f"stale: {out / fresh.name} (run python -m bench.plots)")
                else:
                    print(f"not compared: {fresh.name} was drawn by {drawn_by}, this is {SOURCE}")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Draw every PNG, or check the committed ones."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="the JSON files")
    parser.add_argument("--out", type=Path, default=OUT, help="where the PNGs go")
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args(argv)
    if args.check:
        return check(args.results, args.out)
    for path in draw_all(args.results, args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
