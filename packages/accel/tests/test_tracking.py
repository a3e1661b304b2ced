"""Trackers: the JSON-lines tracker's files, TensorBoard dispatch and ``filter_trackers``."""

from __future__ import annotations

import json
import logging
import math
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from accel import Accelerator, tracking
from accel.tracking import (
    GeneralTracker,
    JSONLTracker,
    TensorBoardTracker,
    filter_trackers,
    get_available_trackers,
)
from accel.tracking import base as tracking_base
from accel_state import LoggerType
from accel_state.testing import run_on_cpu


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


class _RecordingTracker(GeneralTracker):
    """A custom tracker that needs no directory."""

    name = "recording"
    requires_logging_directory = False

    def __init__(self, run_name: str = "run", **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.kwargs = kwargs
        self.logged: list[tuple[dict[str, Any], int | None]] = []

    @property
    def tracker(self) -> list[tuple[dict[str, Any], int | None]]:
        return self.logged

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.logged.append((values, step))


class _DirectoryTracker(_RecordingTracker):
    name = "directory"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str, **kwargs: Any) -> None:
        super().__init__(run_name, **kwargs)
        self.logging_dir = logging_dir


# --- GeneralTracker -------------------------------------------------------------------------


def test_general_tracker_defaults() -> None:
    assert GeneralTracker.main_process_only is True
    blank = GeneralTracker(_blank=True)
    blank.start()
    blank.store_init_configuration({"a": 1})
    blank.log({"loss": 1.0}, step=1)
    blank.finish()


def test_subclass_missing_attributes_is_refused() -> None:
    class Incomplete(GeneralTracker):
        name = "incomplete"

    with pytest.raises(NotImplementedError) as info:
        Incomplete()
    assert "requires_logging_directory" in str(info.value)
    assert "tracker" in str(info.value)


def test_custom_subclass_works() -> None:
    tracker = _RecordingTracker()
    tracker.log({"x": 1}, step=2)
    assert tracker.tracker == [({"x": 1}, 2)]


# --- JSONLTracker ---------------------------------------------------------------------------


def test_jsonl_round_trip(tmp_path: Path) -> None:
    tracker = JSONLTracker("run1", tmp_path)
    assert tracker.name == "jsonl"
    assert tracker.requires_logging_directory is True
    tracker.start()
    assert tracker.metrics_path == tmp_path / "run1" / "metrics.jsonl"
    tracker.log({"loss": 0.5, "lr": 1e-3, "phase": "train"}, step=0)
    tracker.log({"loss": torch.tensor(0.25), "acc": np.float32(0.75)}, step=1)
    tracker.log({"note": None, "flag": True})
    tracker.finish()

    lines = _lines(tmp_path / "run1" / "metrics.jsonl")
    assert [line["step"] for line in lines] == [0, 1, None]
    assert lines[0] == {
        "step": 0,
        "time": lines[0]["time"],
        "loss": 0.5,
        "lr": 1e-3,
        "phase": "train",
    }
    assert list(lines[0])[:2] == ["step", "time"]
    assert lines[1]["loss"] == 0.25 and lines[1]["acc"] == 0.75
    assert lines[2]["note"] is None and lines[2]["flag"] is True
    times = [line["time"] for line in lines]
    assert all(isinstance(t, float) for t in times) and times == sorted(times)


def test_jsonl_converts_tensors_and_numpy(tmp_path: Path) -> None:
    tracker = JSONLTracker("run", tmp_path)
    tracker.log(
        {
            "scalar": torch.tensor(3),
            "vector": torch.tensor([1.0, 2.0]),
            "matrix": torch.arange(4).reshape(2, 2),
            "grad_tensor": torch.tensor(2.0, requires_grad=True) * 2,
            "np_int": np.int64(7),
            "np_array": np.array([[1, 2], [3, 4]]),
            "nested": {"a": torch.tensor(1.5), "b": [np.float64(2.5), (1, 2)]},
        },
        step=np.int64(5),
    )
    (line,) = _lines(tracker.metrics_path)
    assert line["step"] == 5
    assert line["scalar"] == 3 and isinstance(line["scalar"], int)
    assert line["vector"] == [1.0, 2.0]
    assert line["matrix"] == [[0, 1], [2, 3]]
    assert line["grad_tensor"] == 4.0
    assert line["np_int"] == 7
    assert line["np_array"] == [[1, 2], [3, 4]]
    assert line["nested"] == {"a": 1.5, "b": [2.5, [1, 2]]}


def test_jsonl_non_finite_floats_are_strings(tmp_path: Path) -> None:
    tracker = JSONLTracker("run", tmp_path)
    tracker.log(
        {
            "nan": math.nan,
            "inf": math.inf,
            "ninf": -math.inf,
            "tensor_nan": torch.tensor(float("nan")),
            "list": torch.tensor([1.0, float("inf")]),
        },
        step=1,
    )
    raw = tracker.metrics_path.read_text(encoding="utf-8")
    assert "NaN," not in raw.replace('"NaN"', "")  # nothing unquoted: strict JSON
    line = json.loads(raw, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))
    assert line["nan"] == "NaN"
    assert line["inf"] == "Infinity"
    assert line["ninf"] == "-Infinity"
    assert line["tensor_nan"] == "NaN"
    assert line["list"] == [1.0, "Infinity"]


def test_jsonl_lines_are_on_disk_before_finish(tmp_path: Path) -> None:
    tracker = JSONLTracker("run", tmp_path)
    tracker.start()
    for step in range(3):
        tracker.log({"loss": float(step)}, step=step)
        # read through a separate handle, as a crashed run's file would be read
        assert len(_lines(tmp_path / "run" / "metrics.jsonl")) == step + 1
    tracker.finish()
    tracker.finish()  # idempotent


def test_jsonl_creates_directory_on_first_log_and_appends_on_resume(tmp_path: Path) -> None:
    base = tmp_path / "does" / "not" / "exist"
    first = JSONLTracker("run", base)
    assert not base.exists()  # construction writes nothing
    first.log({"loss": 1.0}, step=1)
    first.finish()
    second = JSONLTracker("run", str(base))
    second.start()
    second.log({"loss": 0.5}, step=2)
    second.finish()
    assert [line["step"] for line in _lines(base / "run" / "metrics.jsonl")] == [1, 2]


def test_jsonl_bad_value_raises_and_writes_nothing(tmp_path: Path) -> None:
    tracker = JSONLTracker("run", tmp_path)
    tracker.log({"ok": 1}, step=0)

    class Opaque:
        pass

    with pytest.raises(TypeError) as info:
        tracker.log({"loss": 1.0, "weird": Opaque()}, step=1)
    assert "'weird'" in str(info.value) and "Opaque" in str(info.value)
    with pytest.raises(TypeError, match="complex"):
        tracker.log({"z": torch.tensor(1 + 2j)}, step=1)
    with pytest.raises(TypeError, match=r"'cfg'\['inner'\]"):
        tracker.log({"cfg": {"inner": object()}}, step=1)
    with pytest.raises(TypeError, match="must be strings"):
        tracker.log({1: 2.0}, step=1)  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="step"):
        tracker.log({"loss": 1.0}, step=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'time'"):
        tracker.log({"time": 3.0}, step=1)
    with pytest.raises(TypeError, match="unexpected keyword"):
        tracker.log({"loss": 1.0}, step=1, commit=True)
    tracker.finish()
    raw = tracker.metrics_path.read_text(encoding="utf-8")
    assert raw.endswith("\n") and raw.count("\n") == 1
    assert _lines(tracker.metrics_path)[0]["ok"] == 1


def test_jsonl_store_init_configuration(tmp_path: Path) -> None:
    tracker = JSONLTracker("run", tmp_path)
    config = {
        "lr": 1e-3,
        "epochs": 3,
        "model": {"name": "mlp", "layers": [2, 2]},
        "output_dir": tmp_path / "out",
        "mixed_precision": LoggerType.TENSORBOARD,  # any str enum: written as its value
        "seed": torch.tensor(42),
        "dropout": math.nan,
    }
    tracker.store_init_configuration(config)
    path = tmp_path / "run" / "config.json"
    text = path.read_text(encoding="utf-8")
    assert json.loads(text) == {
        "dropout": "NaN",
        "epochs": 3,
        "lr": 1e-3,
        "mixed_precision": "tensorboard",
        "model": {"layers": [2, 2], "name": "mlp"},
        "output_dir": str(tmp_path / "out"),
        "seed": 42,
    }
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["config.json"]  # no temp file left

    tracker.store_init_configuration({"lr": 0.1})
    assert json.loads(path.read_text(encoding="utf-8")) == {"lr": 0.1}


def test_jsonl_bad_configuration_keeps_the_old_file(tmp_path: Path) -> None:
    tracker = JSONLTracker("run", tmp_path)
    tracker.store_init_configuration({"lr": 0.1})
    with pytest.raises(TypeError) as info:
        tracker.store_init_configuration({"lr": 0.2, "callback": print})
    assert "'callback'" in str(info.value)
    assert "builtin_function_or_method" in str(info.value)
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == {"lr": 0.1}
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.json"]


def test_jsonl_constructor_checks(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="unexpected keyword"):
        JSONLTracker("run", tmp_path, flush_secs=3)
    with pytest.raises(ValueError, match="run_name"):
        JSONLTracker("", tmp_path)
    with pytest.raises(ValueError, match="run_name"):
        JSONLTracker(str(tmp_path / "abs"), tmp_path)
    tracker = JSONLTracker("nested/run", tmp_path)
    assert tracker.logging_dir == tmp_path / "nested" / "run"
    assert tracker.tracker is None
    tracker.start()
    assert tracker.tracker is not None and not tracker.tracker.closed
    tracker.finish()
    assert tracker.tracker is None


def test_jsonl_does_nothing_off_the_main_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tracking_base, "is_main_process", lambda: False)
    tracker = JSONLTracker("run", tmp_path)
    tracker.start()
    tracker.store_init_configuration({"a": 1})
    tracker.log({"loss": 1.0}, step=1)
    tracker.finish()
    assert not (tmp_path / "run").exists()

    tracker.main_process_only = False
    tracker.log({"loss": 1.0}, step=1)
    tracker.finish()
    assert len(_lines(tmp_path / "run" / "metrics.jsonl")) == 1


def _log_on_every_rank(logging_dir: str) -> bool:
    from accel_state import PartialState

    state = PartialState(cpu=True)
    tracker = JSONLTracker("run", logging_dir)
    tracker.start()
    tracker.log({"rank": state.process_index}, step=0)
    tracker.finish()
    state.wait_for_everyone()
    return bool(state.is_main_process)


def test_jsonl_two_processes_write_once(tmp_path: Path) -> None:
    assert run_on_cpu(_log_on_every_rank, str(tmp_path), world_size=2) == [True, False]
    lines = _lines(tmp_path / "run" / "metrics.jsonl")
    assert [line["rank"] for line in lines] == [0]


# --- TensorBoardTracker ---------------------------------------------------------------------


def _block_tensorboard(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setitem(sys.modules, "tensorboardX", None)


def test_tensorboard_missing_raises_with_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _block_tensorboard(monkeypatch)
    with pytest.raises(ImportError) as info:
        TensorBoardTracker("run", tmp_path)
    assert 'pip install "accel[tensorboard]"' in str(info.value)


class _FakeWriter:
    instances: list[_FakeWriter] = []

    def __init__(self, log_dir: str, **kwargs: Any) -> None:
        self.log_dir = log_dir
        self.kwargs = kwargs
        self.calls: list[tuple[Any, ...]] = []
        _FakeWriter.instances.append(self)

    def add_scalar(self, tag: str, value: Any, global_step: Any = None, **kw: Any) -> None:
        self.calls.append(("add_scalar", tag, value, global_step, kw))

    def add_text(self, tag: str, value: Any, global_step: Any = None, **kw: Any) -> None:
        self.calls.append(("add_text", tag, value, global_step, kw))

    def add_scalars(self, tag: str, value: Any, global_step: Any = None, **kw: Any) -> None:
        self.calls.append(("add_scalars", tag, value, global_step, kw))

    def add_hparams(self, hparams: dict[str, Any], metric_dict: dict[str, Any]) -> None:
        self.calls.append(("add_hparams", hparams, metric_dict))

    def add_images(self, tag: str, value: Any, global_step: Any = None, **kw: Any) -> None:
        self.calls.append(("add_images", tag, value, global_step, kw))

    def flush(self) -> None:
        self.calls.append(("flush",))

    def close(self) -> None:
        self.calls.append(("close",))


@pytest.fixture
def fake_tensorboard(monkeypatch: pytest.MonkeyPatch) -> type[_FakeWriter]:
    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = _FakeWriter  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    _FakeWriter.instances = []
    return _FakeWriter


def test_tensorboard_dispatch(tmp_path: Path, fake_tensorboard: type[_FakeWriter]) -> None:
    tracker = TensorBoardTracker("run", tmp_path, flush_secs=5)
    assert fake_tensorboard.instances == []  # the writer is created by start()
    tracker.start()
    (writer,) = fake_tensorboard.instances
    assert tracker.tracker is writer
    assert writer.log_dir == str(tmp_path / "run") and writer.kwargs == {"flush_secs": 5}

    tracker.log(
        {"loss": 0.5, "n": 3, "t": torch.tensor(2.0), "msg": "hi", "pair": {"a": 1, "b": 2.0}},
        step=7,
    )
    assert writer.calls == [
        ("add_scalar", "loss", 0.5, 7, {}),
        ("add_scalar", "n", 3, 7, {}),
        ("add_scalar", "t", 2.0, 7, {}),
        ("add_text", "msg", "hi", 7, {}),
        ("add_scalars", "pair", {"a": 1, "b": 2.0}, 7, {}),
        ("flush",),
    ]
    writer.calls.clear()
    with pytest.raises(TypeError, match="'bad'"):
        tracker.log({"ok": 1.0, "bad": [1, 2]}, step=8)
    assert writer.calls == []  # validated before anything is written

    tracker.store_init_configuration(
        {"lr": 0.1, "opt": {"name": "adam", "betas": (0.9, 0.99)}, "none": None}
    )
    assert writer.calls[0] == (
        "add_hparams",
        {"lr": 0.1, "opt/name": "adam", "opt/betas": "(0.9, 0.99)", "none": "None"},
        {},
    )
    # and, as Accelerate, <run dir>/<unix time>/hparams.yml with the configuration as given
    import yaml

    (saved,) = (tmp_path / "run").glob("*/hparams.yml")
    assert yaml.safe_load(saved.read_text()) == {
        "lr": 0.1,
        "opt": {"name": "adam", "betas": [0.9, 0.99]},
        "none": None,
    }

    # a list of images becomes one NHWC batch; a batch array passes as given (Accelerate's)
    writer.calls.clear()
    hwc = np.zeros((4, 6, 3), dtype=np.uint8)
    chw = torch.ones(3, 4, 6)
    batch = np.zeros((2, 3, 4, 6))
    tracker.log_images({"list": [hwc, chw], "batch": batch}, step=2)
    (_, tag, stacked, step, options), passed, flush = writer.calls
    assert (tag, stacked.shape, step, options) == ("list", (2, 4, 6, 3), 2, {"dataformats": "NHWC"})
    assert passed == ("add_images", "batch", batch, 2, {}) and flush == ("flush",)
    with pytest.raises(ValueError, match="shapes differ"):
        tracker.log_images({"mixed": [hwc, np.zeros((5, 5, 3))]})
    tracker.finish()
    assert writer.calls[-1] == ("close",)
    assert tracker.tracker is None


def test_tensorboard_real(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    tracker = TensorBoardTracker("run", tmp_path)
    tracker.start()
    tracker.store_init_configuration({"lr": 0.1, "name": "x"})
    tracker.log({"loss": 0.5, "text": "hello", "group": {"a": 1.0}}, step=1)
    tracker.finish()
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "run").rglob("*"))


# --- filter_trackers / get_available_trackers -----------------------------------------------


@pytest.fixture
def only_tensorboard_may_be_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the other library trackers look uninstalled (they may be, in nox -s trackers)."""
    for name in tracking.LOGGER_TYPE_TO_CLASS:
        if name not in ("jsonl", "tensorboard"):
            monkeypatch.setitem(tracking.AVAILABILITY, name, lambda: False)


@pytest.mark.usefixtures("only_tensorboard_may_be_installed")
def test_available_trackers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(tracking.AVAILABILITY, "tensorboard", lambda: False)
    assert get_available_trackers() == ["jsonl"]
    monkeypatch.setitem(tracking.AVAILABILITY, "tensorboard", lambda: True)
    assert get_available_trackers() == ["jsonl", "tensorboard"]


def test_filter_none_and_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(tracking.AVAILABILITY, "tensorboard", lambda: True)
    assert filter_trackers(None) == []
    assert filter_trackers([]) == []
    assert filter_trackers("jsonl", tmp_path) == ["jsonl"]
    result = filter_trackers([LoggerType.TENSORBOARD, "JSONL", "jsonl"], tmp_path)
    assert result == ["tensorboard", "jsonl"]
    assert all(type(name) is str for name in result)
    assert LoggerType.TENSORBOARD in result


@pytest.mark.usefixtures("only_tensorboard_may_be_installed")
def test_filter_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(tracking.AVAILABILITY, "tensorboard", lambda: True)
    assert filter_trackers("all", tmp_path) == ["jsonl", "tensorboard"]
    assert filter_trackers(LoggerType.ALL, tmp_path) == ["jsonl", "tensorboard"]
    custom = _RecordingTracker()
    assert filter_trackers([custom, "all", "jsonl"], tmp_path) == [custom, "jsonl", "tensorboard"]
    monkeypatch.setitem(tracking.AVAILABILITY, "tensorboard", lambda: False)
    assert filter_trackers("all", tmp_path) == ["jsonl"]


def test_filter_unknown_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        filter_trackers("nope", tmp_path)
    message = str(info.value)
    assert "'nope'" in message
    for choice in ("'all'", "'jsonl'", "'tensorboard'", "GeneralTracker"):
        assert choice in message
    with pytest.raises(ValueError, match="not a tracker"):
        filter_trackers([42], tmp_path)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="not a tracker"):
        filter_trackers([int], tmp_path)  # type: ignore[list-item]


@pytest.mark.usefixtures("only_tensorboard_may_be_installed")
def test_filter_refuses_a_named_tracker_whose_library_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(tracking.AVAILABILITY, "tensorboard", lambda: False)
    for log_with in (["jsonl", "tensorboard"], LoggerType.TENSORBOARD):
        with pytest.raises(ImportError) as info:
            filter_trackers(log_with, tmp_path)
        assert "'tensorboard'" in str(info.value)
        assert 'pip install "accel[tensorboard]"' in str(info.value)
    # "all" means the installed ones: nothing was named, nothing is refused
    assert filter_trackers("all", tmp_path) == ["jsonl"]


def test_filter_requires_logging_dir() -> None:
    with pytest.raises(ValueError) as info:
        filter_trackers("jsonl")
    assert "'jsonl'" in str(info.value)
    assert "project_dir" in str(info.value) and "logging_dir" in str(info.value)
    with pytest.raises(ValueError, match="_DirectoryTracker"):
        filter_trackers(_DirectoryTracker)


def test_all_without_a_logging_dir_leaves_out_the_file_trackers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Accelerate's Accelerator(log_with="all") works without project_dir: "all" is what can run.
    with caplog.at_level("INFO", logger="accel.tracking.registry"):
        chosen = filter_trackers("all")
    assert "jsonl" not in chosen and "tensorboard" not in chosen
    assert "log_with='all' leaves out 'jsonl'" in caplog.text and "project_dir" in caplog.text
    custom = _RecordingTracker()
    assert filter_trackers([custom, "all"]) == [custom, *chosen]
    assert Accelerator(cpu=True, log_with="all").log_with == chosen


def test_filter_custom_instances_and_classes(tmp_path: Path) -> None:
    instance = _RecordingTracker()
    other = _RecordingTracker()
    assert filter_trackers(instance) == [instance]
    assert filter_trackers([instance, instance, other]) == [instance, other]
    assert filter_trackers(_RecordingTracker) == [_RecordingTracker]
    assert filter_trackers((_RecordingTracker, _RecordingTracker)) == [_RecordingTracker]
    assert filter_trackers([_DirectoryTracker, "jsonl"], tmp_path) == [_DirectoryTracker, "jsonl"]
    # an instance needing a directory is already built: nothing to check
    built = _DirectoryTracker("run", str(tmp_path))
    assert filter_trackers(built) == [built]


def test_make_trackers(tmp_path: Path) -> None:
    instance = _RecordingTracker()
    specs = filter_trackers(["jsonl", _RecordingTracker, _DirectoryTracker, instance], tmp_path)
    built = tracking.make_trackers(
        specs, "proj", tmp_path, init_kwargs={"recording": {"color": "red"}}
    )
    jsonl, recording, directory, same = built
    assert isinstance(jsonl, JSONLTracker) and jsonl.logging_dir == tmp_path / "proj"
    assert isinstance(recording, _RecordingTracker) and recording.kwargs == {"color": "red"}
    assert recording.run_name == "proj"
    assert isinstance(directory, _DirectoryTracker)
    assert str(directory.logging_dir) == str(tmp_path)
    assert same is instance


def test_public_names() -> None:
    assert sorted(tracking.__all__) == [
        "AimTracker",
        "ClearMLTracker",
        "CometMLTracker",
        "DVCLiveTracker",
        "GeneralTracker",
        "JSONLTracker",
        "LOGGER_TYPE_TO_CLASS",
        "MLflowTracker",
        "SwanLabTracker",
        "TensorBoardTracker",
        "TrackioTracker",
        "WandBTracker",
        "filter_trackers",
        "get_available_trackers",
        "on_main_process",
        "register_tracker_class",
    ]


# --- Accelerate's registry names ------------------------------------------------------------


@pytest.fixture
def registry() -> Iterator[dict[str, Any]]:
    """A private copy of the tracker registry, so that registering leaves nothing behind."""
    classes, availability = dict(tracking.LOGGER_TYPE_TO_CLASS), dict(tracking.AVAILABILITY)
    yield tracking.LOGGER_TYPE_TO_CLASS
    tracking.LOGGER_TYPE_TO_CLASS.clear()
    tracking.LOGGER_TYPE_TO_CLASS.update(classes)
    tracking.AVAILABILITY.clear()
    tracking.AVAILABILITY.update(availability)


def test_register_tracker_class_makes_log_with_accept_its_name(
    registry: dict[str, Any], tmp_path: Path
) -> None:
    from accel.accelerator import Accelerator

    tracking.register_tracker_class(_RecordingTracker)
    assert registry["recording"] is _RecordingTracker
    assert "recording" in tracking.get_available_trackers()
    accelerator = Accelerator(cpu=True, log_with="recording", project_dir=tmp_path)
    accelerator.init_trackers("run", init_kwargs={"recording": {"color": "red"}})
    accelerator.log({"loss": 1.0}, step=3)
    (tracker,) = accelerator.trackers
    assert isinstance(tracker, _RecordingTracker) and tracker.kwargs == {"color": "red"}
    assert tracker.logged == [({"loss": 1.0}, 3)]


def test_register_tracker_class_refuses_what_it_cannot_build(registry: dict[str, Any]) -> None:
    class Nameless(_RecordingTracker):
        name = ""

    with pytest.raises(ValueError, match="subclass of GeneralTracker"):
        tracking.register_tracker_class(dict)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Nameless needs a non-empty `name`"):
        tracking.register_tracker_class(Nameless)
    assert "" not in registry


def test_registering_a_taken_name_warns_and_replaces(registry: dict[str, Any]) -> None:
    class OtherJSONL(_RecordingTracker):
        name = "jsonl"

    with pytest.warns(UserWarning, match="'jsonl' is already registered"):
        tracking.register_tracker_class(OtherJSONL)
    assert registry["jsonl"] is OtherJSONL


_LIBRARIES = {
    "wandb": ("WandBTracker", "wandb", "wandb"),
    "mlflow": ("MLflowTracker", "mlflow", "mlflow"),
    "comet_ml": ("CometMLTracker", "comet_ml", "comet-ml"),
    "aim": ("AimTracker", "aim", "aim"),
    "clearml": ("ClearMLTracker", "clearml", "clearml"),
    "dvclive": ("DVCLiveTracker", "dvclive", "dvclive"),
    "swanlab": ("SwanLabTracker", "swanlab", "swanlab"),
    "trackio": ("TrackioTracker", "trackio", "trackio"),
}


def test_every_accelerate_tracker_is_registered_under_its_name() -> None:
    assert set(tracking.LOGGER_TYPE_TO_CLASS) == {"jsonl", "tensorboard", *_LIBRARIES}
    assert {str(member) for member in LoggerType} - {"all"} <= set(tracking.LOGGER_TYPE_TO_CLASS)
    for name, (class_name, _, _) in _LIBRARIES.items():
        cls = getattr(tracking, class_name)
        assert tracking.LOGGER_TYPE_TO_CLASS[name] is cls and cls.name == name
        assert issubclass(cls, GeneralTracker) and cls.main_process_only


@pytest.mark.parametrize("name", sorted(_LIBRARIES))
def test_a_tracker_without_its_library_is_an_import_error_with_the_pip_command(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class_name, module, extra = _LIBRARIES[name]
    command = f'pip install "accel[{extra}]"'
    monkeypatch.setitem(sys.modules, module, None)  # makes `import <module>` fail
    cls = getattr(tracking, class_name)
    with pytest.raises(ImportError) as info:
        cls("run", str(tmp_path)) if cls.requires_logging_directory else cls("run")
    assert command in str(info.value) and class_name in str(info.value)
    # named in log_with: refused before any tracker is built, not left out
    monkeypatch.setitem(tracking.AVAILABILITY, name, lambda: False)
    with pytest.raises(ImportError, match=re.escape(command)):
        filter_trackers(["jsonl", name], tmp_path)
    assert name not in filter_trackers("all", tmp_path)


class _MainOnly(_RecordingTracker):
    main_process_only = True

    @tracking.on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.logged.append((values, step))


def test_on_main_process_skips_the_method_on_other_ranks_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The decorator of Accelerate's tracker API, for users' own trackers (2 ranks above)."""
    tracker = _MainOnly()
    tracker.log({"x": 1})
    monkeypatch.setattr(tracking_base, "is_main_process", lambda: False)
    tracker.log({"x": 2})
    tracker.main_process_only = False
    tracker.log({"x": 3})
    assert tracker.logged == [({"x": 1}, None), ({"x": 3}, None)]


# --- the documentation's custom-tracker recipe, on 2 processes ------------------------------
#
# Accelerate's guide (usage_guides/tracking.md, "Implementing Custom Trackers") with
# ``accelerate`` renamed: ``__init__`` and the logging methods carry ``@on_main_process``, the
# instance is built before the Accelerator and passed in ``log_with``; or the class is
# registered with ``register_tracker_class`` and named in ``log_with``. The guide's wandb
# calls are replaced by a stand-in library writing JSON lines, so that the test reads back
# which process did what.


class _StandInLibrary:
    """Stands for the guide's ``wandb``: ``init`` opens a run, the run writes JSON lines."""

    def __init__(self, folder: str, run_name: str) -> None:
        import os

        self.path = Path(folder) / f"{run_name}.jsonl"
        self.rank = os.environ.get("RANK")
        self.write("init", None)

    def write(self, event: str, values: Any, step: int | None = None) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            line = {"event": event, "rank": self.rank, "values": values, "step": step}
            handle.write(json.dumps(line) + "\n")


class RecipeTracker(GeneralTracker):
    name = "recipe"
    requires_logging_directory = False

    @tracking.on_main_process
    def __init__(self, run_name: str, folder: str) -> None:
        self.run_name = run_name
        self.run = _StandInLibrary(folder, run_name)

    @property
    def tracker(self) -> _StandInLibrary:
        return self.run

    @tracking.on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run.write("config", values)

    @tracking.on_main_process
    def log(self, values: dict[str, Any], step: int | None = None) -> None:
        self.run.write("log", values, step)


def _recipe_rank(folder: str, registered: bool) -> dict[str, Any]:
    from accel import Accelerator

    if registered:
        tracking.register_tracker_class(RecipeTracker)
        accelerator = Accelerator(cpu=True, log_with="recipe")
        init_kwargs = {"recipe": {"folder": folder}}
        constructed = None
    else:
        # as in the guide: built on every process before the Accelerator (no state yet)
        tracker = RecipeTracker("some_run_name", folder)
        constructed = hasattr(tracker, "run_name")
        accelerator = Accelerator(cpu=True, log_with=tracker)
        init_kwargs = None
    accelerator.init_trackers("some_run_name", config={"lr": 0.1}, init_kwargs=init_kwargs)
    accelerator.log({"loss": 0.5}, step=1)
    blank = accelerator.get_tracker("recipe")
    blank.log({"loss": 9.0}, step=9)  # does nothing on the other process
    started = len(accelerator.trackers)
    accelerator.end_training()
    return {"constructed": constructed, "started": started}


@pytest.mark.parametrize("registered", [False, True], ids=["instance", "registered"])
def test_the_custom_tracker_recipe_runs_on_the_main_process_only(
    tmp_path: Path, registered: bool
) -> None:
    ranks = run_on_cpu(_recipe_rank, str(tmp_path), registered, world_size=2, timeout=120)
    constructed = [True, False] if not registered else [None, None]
    assert ranks == [
        {"constructed": constructed[0], "started": 1},
        {"constructed": constructed[1], "started": 0},
    ]
    assert _lines(tmp_path / "some_run_name.jsonl") == [
        {"event": "init", "rank": "0", "values": None, "step": None},
        {"event": "config", "rank": "0", "values": {"lr": 0.1}, "step": None},
        {"event": "log", "rank": "0", "values": {"loss": 0.5}, "step": 1},
        {"event": "log", "rank": "0", "values": {"loss": 9.0}, "step": 9},
    ]


# --- value conversions shared by the library trackers ---------------------------------------


def test_is_main_process_reads_the_launcher_before_any_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tracker built before the Accelerator (the guide's recipe) knows its rank already."""
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    assert tracking_base.is_main_process()  # no launcher: a lone script is the main process
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert not tracking_base.is_main_process()
    monkeypatch.setenv("RANK", "0")
    assert tracking_base.is_main_process()
    monkeypatch.setenv("RANK", "5")
    with pytest.raises(ValueError, match="RANK=5"):
        tracking_base.is_main_process()


def test_numbers_only_keeps_numbers_and_names_what_it_leaves_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from accel.tracking.values import numbers_only

    warned: set[str] = set()
    values = {"loss": torch.tensor(0.5), "n": np.int64(3), "text": "hi", "list": [1, 2]}
    with caplog.at_level(logging.WARNING):
        assert numbers_only(values, "T", warned, "fix it") == {"loss": 0.5, "n": 3}
        numbers_only(values, "T", warned, "fix it")  # a key is named once
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2 and "'text'" in messages[0] and "'list'" in messages[1]
    assert all("fix it" in message for message in messages)
    assert numbers_only(values, "T", set(), "", strings=True) == {
        "loss": 0.5,
        "n": 3,
        "text": "hi",
    }


def test_pil_image_converts_arrays_and_tensors() -> None:
    pytest.importorskip("PIL")
    from accel.tracking.values import pil_image

    install = 'pip install "accel[comet-ml]"'
    gray = pil_image(np.full((4, 6), 7, dtype=np.uint8), "g", install)
    assert (gray.mode, gray.size) == ("L", (6, 4))
    chw = pil_image(torch.ones(3, 4, 6), "t", install)  # floats in 0..1, channels first
    assert (chw.mode, chw.size, chw.getpixel((0, 0))) == ("RGB", (6, 4), (255, 255, 255))
    assert pil_image(np.zeros((4, 6, 4), dtype=np.int64), "i", install).mode == "RGBA"
    assert pil_image(chw, "same", install) is chw
    with pytest.raises(ValueError, match="'wide'.*shape"):
        pil_image(np.zeros((2, 4, 6, 3)), "wide", install)
    with pytest.raises(ValueError, match="outside 0..255"):
        pil_image(np.full((2, 2), 300), "big", install)
    with pytest.raises(ValueError, match="NaN"):
        pil_image(np.full((2, 2), np.nan), "nan", install)


def test_pil_image_without_pillow_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from accel.tracking.values import pil_image

    monkeypatch.setitem(sys.modules, "PIL", None)
    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    with pytest.raises(ImportError, match=re.escape('needs Pillow: pip install "accel[comet-ml]"')):
        pil_image(np.zeros((2, 2)), "x", 'pip install "accel[comet-ml]"')
