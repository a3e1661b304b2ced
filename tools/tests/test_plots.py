"""Tests for tools/docs/plots.py: small result files in tools/tests/data/bench_results/."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import statistics
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "docs" / "plots.py"
FIXTURES = Path(__file__).resolve().parent / "data" / "bench_results"
NAMES = ["train_step_overhead", "offload_prefetch", "checkpoint_stall"]


@pytest.fixture(scope="module")
def plots() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_plots", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_plots"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def results(tmp_path: Path) -> Path:
    folder = tmp_path / "results"
    shutil.copytree(FIXTURES, folder)
    return folder


def _edit(path: Path, change: Any) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    change(data)
    path.write_text(json.dumps(data), encoding="utf-8")


def test_every_plot_is_an_svg_with_its_caption(
    plots: ModuleType, results: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    written = plots.write_plots(results, out)
    assert [p.name for p in written] == [f"{name}.svg" for name in NAMES]
    for path in written:
        text = path.read_text(encoding="utf-8")
        assert ET.fromstring(text).tag.endswith("svg")
        assert "Test CPU, 2 CPUs, 2026-12-01" in text  # the caption, as an SVG comment
        assert "<dc:date>" not in text
    # "--" cannot appear in an XML comment: matplotlib writes "- -"
    assert "python tools/bench/train_step.py - -pairs 4" in (out / f"{NAMES[0]}.svg").read_text()


def test_the_svg_does_not_change_between_builds(
    plots: ModuleType, results: Path, tmp_path: Path
) -> None:
    first = [p.read_bytes() for p in plots.write_plots(results, tmp_path / "a")]
    second = [p.read_bytes() for p in plots.write_plots(results, tmp_path / "b")]
    assert first == second


def test_main_writes_the_plots_and_names_them(
    plots: ModuleType, results: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert plots.main(["--out", str(tmp_path / "out"), "--results", str(results)]) == 0
    assert capsys.readouterr().out.count("wrote ") == 3


def test_train_step_ratios_are_medians_of_the_pairs(plots: ModuleType) -> None:
    record = plots.read_record(FIXTURES / "train_step.json")
    figures = plots.train_step_figures(record)
    assert list(figures) == [1, 2]
    accel = figures[1]["accel"]
    assert accel.value == pytest.approx(statistics.median([1.0, 1.05, 0.95, 1.1]))
    assert accel.low <= accel.value <= accel.high
    assert figures[2]["accelerate"].label == "Accelerate 1.15"


def test_offload_bounds_come_from_the_measured_bandwidth_and_compute(plots: ModuleType) -> None:
    figures = plots.offload_figures(plots.read_record(FIXTURES / "offload.json"))
    assert figures.depths == [0, 1, 2]
    # 1 GB at 1 GB/s: 1 s of reading per 64-token forward; in RAM the forward takes 1 s too
    assert figures.bandwidth_bound.value == pytest.approx(64.0)
    assert figures.compute_bound.value == pytest.approx(64.0)
    assert figures.bandwidth_gbs == pytest.approx(1.0)
    assert [round(b.value, 1) for b in figures.cold] == [32.0, 57.6, 64.0]
    assert figures.cold[1].low == pytest.approx(64 / 1.25)
    assert figures.accelerate.value == pytest.approx(16.0)


def test_checkpoint_bars_start_at_the_copy_floor(plots: ModuleType) -> None:
    bars, state_mb, speed = plots.checkpoint_figures(
        plots.read_record(FIXTURES / "checkpoint_async.json")
    )
    assert [b.label.split()[0] for b in bars] == ["copy", "accel", "torch", "raw", "accel"]
    assert bars[0].value == pytest.approx(0.1)
    assert state_mb == 906.0
    assert speed.value == pytest.approx(1.0)


def test_dcp_that_did_not_run_is_left_out(plots: ModuleType, results: Path) -> None:
    path = results / "checkpoint_async.json"
    _edit(path, lambda d: d["results"].update(dcp_async=[None, None, None]))
    bars, _, _ = plots.checkpoint_figures(plots.read_record(path))
    assert "torch DCP async_save" not in [b.label for b in bars]


def test_the_newest_file_of_a_benchmark_is_drawn(plots: ModuleType, results: Path) -> None:
    newer = results / "train_step-newer.json"
    shutil.copy(results / "train_step.json", newer)
    _edit(newer, lambda d: d.update(date="2026-12-03T08:00:00+00:00", command="python newer"))
    assert plots.newest_records(results)["train_step"].command == "python newer"


def test_a_missing_result_file_fails_and_says_which(
    plots: ModuleType, results: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (results / "offload.json").unlink()
    assert plots.main(["--out", str(tmp_path / "out"), "--results", str(results)]) == 1
    assert "no result file of offload" in capsys.readouterr().err
    with pytest.raises(plots.PlotError, match="no such folder"):
        plots.write_plots(tmp_path / "nowhere", tmp_path / "out")


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("train_step.json", lambda d: d.pop("command"), "no 'command'"),
        ("train_step.json", lambda d: d.update(format=2), "'format' is 2"),
        ("train_step.json", lambda d: d.update(date="yesterday"), "not an ISO date"),
        ("train_step.json", lambda d: d.update(results=[]), "'results' is list"),
        (
            "train_step.json",
            lambda d: d["results"]["rows"][0]["raw"].pop(),
            "3 raw blocks but 4 prepared",
        ),
        (
            "train_step.json",
            lambda d: d["results"]["rows"][0].update(prepared=[1.0, -1.0, 1.0, 1.0]),
            "not a positive number",
        ),
        ("train_step.json", lambda d: d["results"]["rows"][0].update(impl="x"), "'impl' 'x'"),
        (
            "offload.json",
            lambda d: d["results"]["cold"]["accel:1"][0]["forward"].pop("ram"),
            "no 'ram'",
        ),
        (
            "offload.json",
            lambda d: [d["results"]["cold"].pop(k) for k in ("accel:1", "accel:2")],
            "the plot needs 2",
        ),
        ("checkpoint_async.json", lambda d: d["results"].pop("async"), "no 'async'"),
        (
            "checkpoint_async.json",
            lambda d: d["results"].update(step_idle=[3.0]),
            "differ in length",
        ),
    ],
)
def test_a_malformed_result_file_fails_and_says_where(
    plots: ModuleType, results: Path, tmp_path: Path, name: str, change: Any, message: str
) -> None:
    _edit(results / name, change)
    with pytest.raises(plots.PlotError, match=re.escape(message)) as error:
        plots.write_plots(results, tmp_path / "out")
    assert name in str(error.value)


def test_a_file_that_is_not_json_fails(plots: ModuleType, results: Path, tmp_path: Path) -> None:
    (results / "broken.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(plots.PlotError, match="broken.json: cannot be read as JSON"):
        plots.write_plots(results, tmp_path / "out")


def test_the_benchmarks_page_shows_each_plot_with_its_command(plots: ModuleType) -> None:
    """The committed result files draw, and docs/benchmarks.md names each one's command."""
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    records = plots.newest_records(plots.RESULTS)
    for name, (benchmark, _, _) in plots.PLOTS.items():
        assert f"](assets/plots/{name}.svg)" in page, name
        assert records[benchmark].command in page, records[benchmark].path
