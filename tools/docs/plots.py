"""Draw the plots of docs/benchmarks.md from the benchmark scripts' result files.

    python tools/docs/plots.py --out docs/assets/plots [--results tools/bench/results]

Reads every ``*.json`` under ``--results`` (written by a benchmark's ``--json FILE``: the
script's figures with the command, date and machine, tools/bench/record.py) and writes one SVG
per plot into ``--out``:

- ``train_step_overhead.svg`` (tools/bench/train_step.py): a training step's time with accel
  and with Accelerate 1.15, each over the same raw PyTorch loop timed in the same process
  (median of the per-pair ratios, interquartile range), single process and 2-process DDP.
- ``offload_prefetch.svg`` (tools/bench/offload.py): tokens/s of a forward whose blocks are
  read from disk with a cold page cache, by prefetch depth, against the disk-bandwidth bound
  (the forward's bytes read at the bandwidth measured beside it) and the compute bound (the
  same forward with every weight in RAM); Accelerate 1.15 for reference.
- ``checkpoint_stall.svg`` (tools/bench/checkpoint_async.py): how long a save stops training,
  accel's asynchronous and synchronous ``save_state`` against the copy of the state into host
  memory, raw ``save_file`` + ``torch.save`` and torch DCP's ``async_save``.

Where a benchmark has several result files, the newest (by its ``date``) is drawn. A missing
or malformed file needed by a plot is an error (exit status 1, the file and the problem named):
the page must not be built from stale or partial data. The output is deterministic (fixed SVG
ids, no date in the metadata), so an unchanged result file gives a byte-identical SVG.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "tools" / "bench" / "results"
FORMAT = 1
ACCEL_COLOR = "#3f51b5"  # Material's indigo, the site's primary colour
ACCELERATE_COLOR = "#9e9e9e"
OTHER_COLOR = "#78909c"  # raw torch, DCP
FLOOR_COLOR = "#cfd8dc"
BOUND_COLOR = "#e65100"
COMPUTE_COLOR = "#2e7d32"


class PlotError(Exception):
    """A result file that a plot needs is missing or malformed."""


@dataclass(frozen=True)
class Record:
    """One result file: what a benchmark measured, with its command, date and machine."""

    path: Path
    benchmark: str
    command: str
    date: datetime.datetime
    machine: dict[str, Any]
    results: dict[str, Any]

    def caption(self) -> str:
        """Lines for under the plot: the command (wrapped), the machine and the date."""
        cpu = self.machine.get("cpu", "unknown CPU")
        cpus = self.machine.get("cpus")
        where = f"{cpu}, {cpus} CPUs" if cpus else str(cpu)
        if self.machine.get("gpu"):
            where += f", {self.machine['gpu']}"
        command = textwrap.wrap(self.command, 130, break_on_hyphens=False, subsequent_indent="  ")
        return "\n".join([*command, f"{where}, {self.date:%Y-%m-%d}"])


# ---------------------------------------------------------------------------------------------
# Reading and checking the result files
# ---------------------------------------------------------------------------------------------


def _field(data: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in data:
        raise PlotError(f"{where}: no {key!r}")
    value = data[key]
    # bool is an int to isinstance; no figure here is a bool unless asked for
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise PlotError(f"{where}: {key!r} is a bool")
    if not isinstance(value, kind):
        raise PlotError(f"{where}: {key!r} is {type(value).__name__}, not the expected type")
    return value


def _numbers(data: dict[str, Any], key: str, where: str, minimum: int = 1) -> list[float]:
    """A list of at least ``minimum`` positive numbers."""
    values = _field(data, key, list, where)
    if len(values) < minimum:
        raise PlotError(f"{where}: {key!r} has {len(values)} values, fewer than {minimum}")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise PlotError(f"{where}: {key!r} holds {value!r}, not a positive number")
    return [float(v) for v in values]


def read_record(path: Path) -> Record:
    """Parse one result file and check the fields every result file has."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PlotError(f"{path}: cannot be read as JSON ({error})") from error
    where = str(path)
    if not isinstance(data, dict):
        raise PlotError(f"{where}: not a JSON object")
    if data.get("format") != FORMAT:
        raise PlotError(f"{where}: 'format' is {data.get('format')!r}, this script reads {FORMAT}")
    date_text = _field(data, "date", str, where)
    try:
        date = datetime.datetime.fromisoformat(date_text)
    except ValueError as error:
        raise PlotError(f"{where}: 'date' {date_text!r} is not an ISO date") from error
    if date.tzinfo is None:
        date = date.replace(tzinfo=datetime.UTC)
    return Record(
        path=path,
        benchmark=_field(data, "benchmark", str, where),
        command=_field(data, "command", str, where),
        date=date,
        machine=_field(data, "machine", dict, where),
        results=_field(data, "results", dict, where),
    )


def newest_records(folder: Path) -> dict[str, Record]:
    """The newest result file of each benchmark in ``folder`` (every file is checked)."""
    if not folder.is_dir():
        raise PlotError(f"{folder}: no such folder of benchmark results")
    newest: dict[str, Record] = {}
    for path in sorted(folder.glob("*.json")):
        record = read_record(path)
        kept = newest.get(record.benchmark)
        if kept is None or record.date > kept.date:
            newest[record.benchmark] = record
    return newest


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile), as the benchmark scripts compute them."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return q1, statistics.median(values), q3


# ---------------------------------------------------------------------------------------------
# Figures: what each plot shows, computed from the results (no drawing)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bar:
    """One bar: its label, value and whiskers (low, high)."""

    label: str
    value: float
    low: float
    high: float


LIBRARIES = {"accel": "accel", "accelerate": "Accelerate 1.15"}


def train_step_figures(record: Record) -> dict[int, dict[str, Bar]]:
    """Per process count, per library: the median per-pair ratio prepared / raw and its IQR."""
    rows = _field(record.results, "rows", list, str(record.path))
    figures: dict[int, dict[str, Bar]] = {}
    for index, row in enumerate(rows):
        where = f"{record.path}: results.rows[{index}]"
        if not isinstance(row, dict):
            raise PlotError(f"{where}: not an object")
        impl = _field(row, "impl", str, where)
        if impl not in LIBRARIES:
            raise PlotError(f"{where}: 'impl' {impl!r} is not one of {sorted(LIBRARIES)}")
        processes = _field(row, "processes", int, where)
        raw = _numbers(row, "raw", where, minimum=2)
        prepared = _numbers(row, "prepared", where, minimum=2)
        if len(raw) != len(prepared):
            raise PlotError(f"{where}: {len(raw)} raw blocks but {len(prepared)} prepared ones")
        q1, median, q3 = quartiles([p / r for p, r in zip(prepared, raw, strict=True)])
        figures.setdefault(processes, {})[impl] = Bar(LIBRARIES[impl], median, q1, q3)
    if not any("accel" in row for row in figures.values()):
        raise PlotError(f"{record.path}: no accel row")
    return dict(sorted(figures.items()))


@dataclass(frozen=True)
class OffloadFigures:
    """Cold-cache tokens/s by prefetch depth and the bounds they are held against."""

    tokens: int
    depths: list[int]
    cold: list[Bar]  # per depth: median tokens/s, range over the forwards
    bandwidth_bound: Bar  # tokens/s if the forward only read its bytes at the disk's bandwidth
    compute_bound: Bar  # tokens/s of the same forward with every weight in RAM
    bandwidth_gbs: float
    accelerate: Bar | None


def _cold_forwards(runs: Any, where: str) -> list[tuple[float, float, float]]:
    """(latency, compute, I/O seconds) of every cold forward of one column's workers."""
    if not isinstance(runs, list) or not runs:
        raise PlotError(f"{where}: not a non-empty list of workers")
    forwards: list[tuple[float, float, float]] = []
    for index, run in enumerate(runs):
        at = f"{where}[{index}]"
        if not isinstance(run, dict):
            raise PlotError(f"{at}: not an object")
        size = _field(run, "bytes", int, at)
        bandwidths = _numbers(run, "bandwidth", at)
        forward = _field(run, "forward", dict, at)
        cold = _numbers(forward, "cold", f"{at}.forward")
        ram = _numbers(forward, "ram", f"{at}.forward")
        if not len(cold) == len(ram) == len(bandwidths):
            raise PlotError(f"{at}: the cold, ram and bandwidth lists differ in length")
        if size <= 0:
            raise PlotError(f"{at}: 'bytes' is {size}")
        forwards += [(c, r, size / b) for c, r, b in zip(cold, ram, bandwidths, strict=True)]
    return forwards


def _quartile_bar(label: str, tokens: int, seconds: list[float]) -> Bar:
    """Tokens/s at the median of ``seconds``, whiskers at its quartiles."""
    low, median, high = quartiles([tokens / s for s in seconds])
    return Bar(label, median, low, high)


def _rate_bar(label: str, tokens: int, seconds: list[float]) -> Bar:
    """Tokens/s at the median of ``seconds``, whiskers at the extremes."""
    rates = [tokens / s for s in seconds]
    return Bar(label, statistics.median(rates), min(rates), max(rates))


def offload_figures(record: Record) -> OffloadFigures:
    """Tokens/s of the cold forward per accel depth, the bounds, and Accelerate's."""
    where = f"{record.path}: results"
    tokens = _field(record.results, "tokens", int, where)
    cold = _field(record.results, "cold", dict, where)
    depths: dict[int, list[tuple[float, float, float]]] = {}
    accelerate = None
    for key, runs in cold.items():
        impl, _, depth = key.partition(":")
        forwards = _cold_forwards(runs, f"{where}.cold[{key!r}]")
        if impl == "accelerate":
            accelerate = _rate_bar("Accelerate 1.15", tokens, [f[0] for f in forwards])
        elif impl == "accel" and depth.isdigit():
            depths[int(depth)] = forwards
        else:
            raise PlotError(f"{where}.cold: unexpected column {key!r}")
    if len(depths) < 2:
        raise PlotError(f"{where}.cold: {len(depths)} accel prefetch depth(s), the plot needs 2+")
    ordered = sorted(depths)
    everything = [f for d in ordered for f in depths[d]]
    io_seconds = [f[2] for f in everything]
    size = _field(cold[f"accel:{ordered[0]}"][0], "bytes", int, where)
    return OffloadFigures(
        tokens=tokens,
        depths=ordered,
        cold=[_rate_bar(f"depth {d}", tokens, [f[0] for f in depths[d]]) for d in ordered],
        bandwidth_bound=_quartile_bar("disk bandwidth", tokens, io_seconds),
        compute_bound=_rate_bar("in RAM", tokens, [f[1] for f in everything]),
        bandwidth_gbs=size / statistics.median(io_seconds) / 1e9,
        accelerate=accelerate,
    )


CHECKPOINT_BARS = [
    ("copy", "copy of the state into host buffers (the floor)"),
    ("async", "accel save_state(async_save=True)"),
    ("dcp_async", "torch DCP async_save"),
    ("raw", "raw save_file + torch.save (no fsync)"),
    ("sync", "accel save_state() (fsync)"),
]


def checkpoint_figures(record: Record) -> tuple[list[Bar], float, Bar]:
    """Seconds training is blocked per way of saving; the state's MB; step speed under a write."""
    where = f"{record.path}: results"
    results = record.results
    bars = []
    for key, label in CHECKPOINT_BARS:
        if key == "dcp_async" and None in results.get(key, []):
            continue  # DCP did not run here (the benchmark wrote null, and why in dcp_note)
        values = _numbers(results, key, where)
        bars.append(Bar(label, statistics.median(values), min(values), max(values)))
    state_mb = _field(results, "state_mb", (int, float), where)
    idle = _numbers(results, "step_idle", where)
    writing = _numbers(results, "step_writing", where)
    if len(idle) != len(writing):
        raise PlotError(f"{where}: step_idle and step_writing differ in length")
    speed = [i / w for i, w in zip(idle, writing, strict=True)]
    return bars, float(state_mb), Bar("speed", statistics.median(speed), min(speed), max(speed))


# ---------------------------------------------------------------------------------------------
# Drawing
# ---------------------------------------------------------------------------------------------


def _setup() -> Any:
    """Import matplotlib with the Agg backend and settings that make the SVG reproducible."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcdefaults()
    matplotlib.rcParams.update(
        {
            "svg.hashsalt": "accel-docs",  # fixed ids in the SVG instead of random ones
            "svg.fonttype": "path",  # glyphs as paths: no font to fetch, same look everywhere
            "font.size": 10,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "figure.dpi": 100,
        }
    )
    return plt


def _start(plt: Any, height: float, title: str) -> tuple[Any, Any]:
    """A figure 7.5 inches wide, laid out by matplotlib, with its title at the left."""
    figure, axes = plt.subplots(figsize=(7.5, height), layout="constrained")
    figure.suptitle(title, x=0.01, ha="left", fontsize=11)
    return figure, axes


def _finish(plt: Any, figure: Any, record: Record, path: Path) -> None:
    """The command and machine under the plot; write the SVG without a date."""
    figure.supxlabel(record.caption(), x=0.01, ha="left", fontsize=7, color="#555555")
    figure.savefig(path, format="svg", metadata={"Date": None}, facecolor="white")
    plt.close(figure)


def draw_train_step(figures: dict[int, dict[str, Bar]], record: Record, path: Path) -> None:
    plt = _setup()
    figure, axes = _start(plt, 3.6, "Training step overhead (median of paired blocks, IQR)")
    width = 0.36
    groups = {1: "single process", 2: "2-process DDP (gloo)"}
    for offset, impl in ((-width / 2, "accel"), (width / 2, "accelerate")):
        xs, bars = [], []
        for index, processes in enumerate(figures):
            if impl in figures[processes]:
                xs.append(index + offset)
                bars.append(figures[processes][impl])
        if not bars:
            continue
        color = ACCEL_COLOR if impl == "accel" else ACCELERATE_COLOR
        heights = [b.value for b in bars]
        errors = [[b.value - b.low for b in bars], [b.high - b.value for b in bars]]
        axes.bar(xs, heights, width, color=color, label=LIBRARIES[impl])
        axes.errorbar(xs, heights, yerr=errors, fmt="none", ecolor="#333333", capsize=3, lw=1)
        for x, bar in zip(xs, bars, strict=True):
            axes.annotate(
                f"{bar.value:.3f}×",
                (x, bar.high),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                fontsize=8,
            )
    axes.axhline(1.0, color="#000000", lw=1, ls="--", label="raw PyTorch loop = 1")
    axes.set_xticks(range(len(figures)))
    axes.set_xticklabels([groups.get(p, f"{p} processes") for p in figures])
    highs = [b.high for row in figures.values() for b in row.values()]
    axes.set_ylim(
        min(0.9, *[b.low for row in figures.values() for b in row.values()]) - 0.02,
        max(highs) + 0.06,
    )
    axes.set_ylabel("step time ÷ raw step time")
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), fontsize=8, ncols=3, frameon=False)
    _finish(plt, figure, record, path)


def draw_offload(figures: OffloadFigures, record: Record, path: Path) -> None:
    plt = _setup()
    figure, axes = _start(plt, 4.0, "Disk offload: tokens/s by prefetch depth, cold page cache")
    depths = figures.depths
    values = [b.value for b in figures.cold]
    errors = [[b.value - b.low for b in figures.cold], [b.high - b.value for b in figures.cold]]
    bound, compute = figures.bandwidth_bound, figures.compute_bound
    axes.axhspan(bound.low, bound.high, color=BOUND_COLOR, alpha=0.12, lw=0)
    axes.axhline(
        bound.value,
        color=BOUND_COLOR,
        lw=1.5,
        ls="--",
        label=f"disk bandwidth bound ({figures.bandwidth_gbs:.2f} GB/s, quartiles shaded)",
    )
    axes.axhline(
        compute.value,
        color=COMPUTE_COLOR,
        lw=1.5,
        ls=":",
        label="compute bound (all weights in RAM)",
    )
    if figures.accelerate is not None:
        axes.axhline(
            figures.accelerate.value,
            color=ACCELERATE_COLOR,
            lw=1.5,
            ls="-.",
            label="Accelerate 1.15",
        )
    axes.errorbar(
        depths,
        values,
        yerr=errors,
        color=ACCEL_COLOR,
        marker="o",
        lw=2,
        capsize=3,
        label="accel, cold page cache (median, range)",
    )
    for depth, value in zip(depths, values, strict=True):
        axes.annotate(
            f"{value:.0f}",
            (depth, value),
            xytext=(6, -12),
            textcoords="offset points",
            fontsize=8,
            color=ACCEL_COLOR,
        )
    axes.set_xticks(depths)
    axes.set_xlabel("prefetch_depth")
    axes.set_ylabel(f"tokens/s (forward of 1×{figures.tokens} tokens)")
    axes.set_ylim(0, max(compute.value, bound.high, max(b.high for b in figures.cold)) * 1.12)
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize=8, ncols=2, frameon=False)
    _finish(plt, figure, record, path)


def draw_checkpoint(figures: tuple[list[Bar], float, Bar], record: Record, path: Path) -> None:
    bars, state_mb, speed = figures
    copy = bars[0].value
    plt = _setup()
    figure, axes = _start(
        plt,
        3.4,
        f"Checkpoint stall, {state_mb:.0f} MB of state: how long training is blocked\n"
        f"training steps during the background write: {speed.value:.2f}× their speed "
        f"(range {speed.low:.2f}-{speed.high:.2f})",
    )
    ys = list(range(len(bars)))[::-1]
    colors = [
        ACCEL_COLOR if b.label.startswith("accel") else FLOOR_COLOR if i == 0 else OTHER_COLOR
        for i, b in enumerate(bars)
    ]
    values = [b.value for b in bars]
    errors = [[b.value - b.low for b in bars], [b.high - b.value for b in bars]]
    axes.barh(ys, values, color=colors, height=0.6)
    axes.errorbar(values, ys, xerr=errors, fmt="none", ecolor="#333333", capsize=3, lw=1)
    for y, bar in zip(ys, bars, strict=True):
        axes.annotate(
            f"{bar.value:.3f} s ({bar.value / copy:.2f}× copy)",
            (bar.high, y),
            xytext=(4, -3),
            textcoords="offset points",
            fontsize=8,
        )
    axes.set_yticks(ys)
    axes.set_yticklabels([b.label for b in bars], fontsize=8)
    axes.set_xlim(0, max(b.high for b in bars) * 1.45)
    axes.set_xlabel("seconds training is blocked (median, range)")
    _finish(plt, figure, record, path)


# name of the SVG: (benchmark, its figures from the result file, the drawing of them)
PLOTS: dict[str, tuple[str, Callable[[Record], Any], Callable[[Any, Record, Path], None]]] = {
    "train_step_overhead": ("train_step", train_step_figures, draw_train_step),
    "offload_prefetch": ("offload", offload_figures, draw_offload),
    "checkpoint_stall": ("checkpoint_async", checkpoint_figures, draw_checkpoint),
}


def write_plots(results: Path, out: Path) -> list[Path]:
    """Draw every plot from the newest result files in ``results``; return the SVGs written.

    Every needed file is read and checked before the first plot is drawn.
    """
    records = newest_records(results)
    missing = sorted({benchmark for benchmark, _, _ in PLOTS.values()} - set(records))
    if missing:
        raise PlotError(
            f"{results}: no result file of {', '.join(missing)} (run the benchmark with "
            "--json FILE into that folder; see docs/benchmarks.md for the commands)"
        )
    figures = {}
    for name, (benchmark, compute, _) in PLOTS.items():
        try:
            figures[name] = compute(records[benchmark])
        except PlotError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError) as error:
            where = records[benchmark].path
            raise PlotError(f"{where}: malformed ({type(error).__name__}: {error})") from error
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (benchmark, _, draw) in PLOTS.items():
        path = out / f"{name}.svg"
        draw(figures[name], records[benchmark], path)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for the SVG files")
    parser.add_argument("--results", type=Path, default=RESULTS, help="benchmark result files")
    args = parser.parse_args(argv)
    try:
        written = write_plots(args.results, args.out)
    except PlotError as error:
        print(f"plots.py: error: {error}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
