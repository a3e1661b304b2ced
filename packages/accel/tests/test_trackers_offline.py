"""Every built-in tracker against its real library, offline.

For each tracker a 2-process run (``run_on_cpu``) does what a training script does with
``log_with=<name>``: ``init_trackers`` with a config, three ``log`` calls, and, on every rank,
``get_tracker(name).log_images`` / ``.log_table`` where the tracker has them. Then a fresh
process reads back what the library wrote, through the library's own reading API where it
has one, and the test compares it with what was logged: the config, the scalars as
``(step, value)``, the image's size, the table's rows, and that there is exactly one run
(the other rank must write nothing).

Nothing touches the network: every library runs in its offline or local mode, ``HOME``
points into the test's temporary folder, and each rank works in that folder.

The libraries are not test dependencies of accel: ``nox -s trackers`` installs them and sets
``ACCEL_REQUIRE_TRACKERS=1``, which turns a missing library into a failure instead of a skip.
"""

from __future__ import annotations

import csv
import glob
import importlib.util
import io
import json
import os
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from accel_state.testing import run_on_cpu

PROJECT = "accel-tracking"
CONFIG = {
    "lr": 0.01,
    "epochs": 3,
    "optimizer": "adamw",
    "amsgrad": False,
    "schedule": {"kind": "cosine", "warmup": 10},
}
# Values exact in float32 (TensorBoard stores float32).
LOSSES = [1.0, 0.5, 0.25]
METRICS = {
    "loss": [(step, loss) for step, loss in enumerate(LOSSES)],
    "acc": [(step, 1.0 - loss / 2) for step, loss in enumerate(LOSSES)],
}
IMAGE_SHAPE = (8, 12, 3)  # height, width, channels
TABLE_COLUMNS = ["id", "label"]
TABLE_ROWS = [[0, "cat"], [1, "dog"]]
LAST_STEP = len(LOSSES) - 1
RUN_TIMEOUT = 150.0  # seconds for one 2-process run (ClearML's close alone waits ~10 s)

#: What a reader returns: {"config": {name: value}, "metrics": {name: [(step, value), ...]},
#: "images": {name: [(height, width), ...]}, "tables": {name: [header, *rows]}, "runs": n}.
Result = dict[str, Any]


@dataclass(frozen=True)
class Case:
    """One tracker: its library, offline setup, what it logs, and how to read it back."""

    module: str  # the library to import (skip or fail without it)
    setup: Callable[[Path], tuple[dict[str, Any], dict[str, str]]]  # init_kwargs, env
    reader: Callable[[Path], Result]
    images: bool  # whether log_images is called (the tracker and library support images)
    tables: bool  # whether log_table is called
    config: dict[str, Any]  # the configuration as the library stores it
    prepare: Callable[[], None] | None = None  # run in each rank before the Accelerator


#: The trackers, by ``log_with`` name (filled at the end of the module, after the readers).
CASES: dict[str, Case] = {}


def _image() -> np.ndarray:
    return (np.arange(np.prod(IMAGE_SHAPE)) % 256).astype(np.uint8).reshape(IMAGE_SHAPE)


def _empty() -> Result:
    return {"config": {}, "metrics": {}, "images": {}, "tables": {}, "runs": 0}


def _size(data: bytes | str | Path) -> tuple[int, int]:
    """(height, width) of an image file or its bytes."""
    from PIL import Image

    source = io.BytesIO(data) if isinstance(data, bytes) else data
    with Image.open(source) as image:
        return image.height, image.width


def _one(paths: list[Any], what: str) -> Any:
    assert len(paths) == 1, f"expected one {what}, found {paths}"
    return paths[0]


# --- the run --------------------------------------------------------------------------------


def _log_a_run(name: str, directory: str, init_kwargs: dict[str, Any]) -> dict[str, Any]:
    """One rank of the run: what a training script does with ``log_with=name``."""
    from accel import Accelerator

    os.chdir(directory)  # anything a library writes next to the script lands in tmp
    case = CASES[name]
    if case.prepare is not None:
        case.prepare()
    accelerator = Accelerator(cpu=True, log_with=name, project_dir=directory)
    accelerator.init_trackers(PROJECT, config=CONFIG, init_kwargs={name: init_kwargs})
    for step, loss in enumerate(LOSSES):
        # a tensor and a float, as a training loop logs them
        accelerator.log({"loss": torch.tensor(loss), "acc": 1.0 - loss / 2}, step=step)
    tracker = accelerator.get_tracker(name)
    # on every rank: the other one gets a blank tracker whose methods do nothing
    if case.images:
        tracker.log_images({"sample": [_image()]}, step=LAST_STEP)
    if case.tables:
        tracker.log_table("predictions", columns=TABLE_COLUMNS, data=TABLE_ROWS, step=LAST_STEP)
    started = [type(started).__name__ for started in accelerator.trackers]
    accelerator.end_training()
    return {"main": accelerator.is_main_process, "started": started}


def _read_back(name: str, directory: str) -> Result:
    """Read what the library wrote, in a fresh process with the run's environment."""
    return CASES[name].reader(Path(directory))


def _require(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        if os.environ.get("ACCEL_REQUIRE_TRACKERS") == "1":
            pytest.fail(
                f"{module} is not installed, and ACCEL_REQUIRE_TRACKERS=1 (nox -s trackers)"
            )
        pytest.skip(f"{module} is not installed (nox -s trackers installs every tracker library)")


def _environment(tmp_path: Path) -> dict[str, str]:
    """What keeps every library local: a private HOME, offline switches, no telemetry."""
    home = tmp_path / "home"
    home.mkdir()
    return {
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "DO_NOT_TRACK": "1",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "COMET_OFFLINE": "1",  # offline, whatever the init_kwargs say
        "CLEARML_OFFLINE_MODE": "1",
        "SWANLAB_MODE": "offline",
        "GRADIO_ANALYTICS_ENABLED": "False",
    }


def _check(name: str, found: Result) -> None:
    case = CASES[name]
    assert found["runs"] == 1, f"{name}: expected one run (the main process's), got {found}"
    config = {key: found["config"].get(key, "<missing>") for key in case.config}
    assert config == case.config, f"{name}: configuration read back: {found['config']}"
    assert found["metrics"] == METRICS, f"{name}: scalars read back: {found['metrics']}"
    if case.images:
        assert found["images"] == {"sample": [IMAGE_SHAPE[:2]]}, f"{name}: {found['images']}"
    if case.tables:
        assert found["tables"] == {"predictions": [TABLE_COLUMNS, *TABLE_ROWS]}, (
            f"{name}: {found['tables']}"
        )


# --- JSONL (no library) ---------------------------------------------------------------------


def _jsonl_setup(directory: Path) -> tuple[dict[str, Any], dict[str, str]]:
    return {}, {}


def read_jsonl(directory: Path) -> Result:
    """``<project_dir>/<project>/metrics.jsonl`` and ``config.json``."""
    result = _empty()
    run = directory / PROJECT
    result["runs"] = int((run / "metrics.jsonl").is_file())
    result["config"] = json.loads((run / "config.json").read_text(encoding="utf-8"))
    for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        for key, value in row.items():
            if key not in ("step", "time"):
                result["metrics"].setdefault(key, []).append((row["step"], value))
    return result


# --- TensorBoard ----------------------------------------------------------------------------


def _tensorboard_setup(directory: Path) -> tuple[dict[str, Any], dict[str, str]]:
    return {"flush_secs": 1}, {}


def read_tensorboard(directory: Path) -> Result:
    """Event files through TensorBoard's ``EventAccumulator`` (and its hparams plugin data)."""
    import yaml
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    result = _empty()
    run = directory / PROJECT
    # one writer (one event file) in the run folder; add_hparams writes a sub-folder
    result["runs"] = len(list(run.glob("events.out.tfevents.*")))
    events = EventAccumulator(str(run), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    for tag in events.Tags()["scalars"]:
        result["metrics"][tag] = [(event.step, event.value) for event in events.Scalars(tag)]
    for tag in events.Tags()["images"]:
        result["images"][tag] = [
            (_size(event.encoded_image_string)) for event in events.Images(tag)
        ]
    hparams_dir = _one(sorted({path.parent for path in run.glob("*/events.out.*")}), "hparams")
    hparams = EventAccumulator(str(hparams_dir))
    hparams.Reload()
    content = hparams.PluginTagToContent(metadata.PLUGIN_NAME)[metadata.SESSION_START_INFO_TAG]
    start = metadata.parse_session_start_info_plugin_data(content)
    flat = {}
    for key, value in start.hparams.items():
        flat[key] = getattr(value, value.WhichOneof("kind"))
    result["config"]["hparams"] = flat
    # Accelerate's hparams.yml, next to the hparams events
    (saved,) = run.glob("*/hparams.yml")
    result["config"]["hparams.yml"] = yaml.safe_load(saved.read_text(encoding="utf-8"))
    return result


# --- wandb ----------------------------------------------------------------------------------

_LEVELDB_BLOCK, _LEVELDB_HEADER = 32 * 1024, 7


def _wandb_records(path: Path) -> list[bytes]:
    """The records of a ``.wandb`` transaction log (LevelDB log format: 32 KiB blocks).

    wandb >= 0.20 has no Python reader of its own any more (its Go core reads the file); the
    records are wandb's own protobuf messages, parsed with its ``wandb_internal_pb2``.
    """
    data = path.read_bytes()
    records: list[bytes] = []
    pending = b""
    position = _LEVELDB_HEADER  # the file header: magic ":W&B", version
    while position + _LEVELDB_HEADER <= len(data):
        left = _LEVELDB_BLOCK - position % _LEVELDB_BLOCK
        if left < _LEVELDB_HEADER:  # a block's tail too short for a header is padding
            position += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position : position + _LEVELDB_HEADER])
        if length == 0 and kind == 0:
            position += left
            continue
        chunk = data[position + _LEVELDB_HEADER : position + _LEVELDB_HEADER + length]
        position += _LEVELDB_HEADER + length
        if kind == 1:  # full
            records.append(chunk)
        elif kind == 2:  # first
            pending = chunk
        elif kind == 3:  # middle
            pending += chunk
        elif kind == 4:  # last
            records.append(pending + chunk)
    return records


def _wandb_setup(directory: Path) -> tuple[dict[str, Any], dict[str, str]]:
    return {"mode": "offline", "dir": str(directory)}, {}


def read_wandb(directory: Path) -> Result:
    """The offline run ``<dir>/wandb/offline-run-*``: its ``.wandb`` log and media files."""
    from wandb.proto import wandb_internal_pb2

    result = _empty()
    runs = sorted(glob.glob(str(directory / "wandb" / "offline-run-*")))
    result["runs"] = len(runs)
    run = Path(_one(runs, "wandb run"))
    log = _one(list(run.glob("run-*.wandb")), ".wandb file")
    for raw in _wandb_records(log):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "config":
            for item in record.config.update:
                if not item.key.startswith("_"):
                    result["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            row: dict[str, Any] = {}  # nested keys ("sample", "width") rebuilt as dicts
            for item in record.history.item:
                path = [item.key] if item.key else list(item.nested_key)
                node = row
                for part in path[:-1]:
                    node = node.setdefault(part, {})
                node[path[-1]] = json.loads(item.value_json)
            step = row.get("_step")
            for key, value in row.items():
                if key.startswith("_"):
                    continue
                kind_of = value.get("_type") if isinstance(value, dict) else None
                if kind_of == "images/separated":
                    result["images"][key] = [
                        _size(run / "files" / filename) for filename in value["filenames"]
                    ]
                elif kind_of == "table-file":
                    table = json.loads((run / "files" / value["path"]).read_text())
                    result["tables"][key] = [table["columns"], *table["data"]]
                else:
                    result["metrics"].setdefault(key, []).append((step, value))
    return result


# --- MLflow ---------------------------------------------------------------------------------


def _mlflow_setup(directory: Path) -> tuple[dict[str, Any], dict[str, str]]:
    store = f"sqlite:///{directory / 'mlflow.db'}"
    return {"tracking_uri": store}, {"MLFLOW_TRACKING_URI": store}


def read_mlflow(directory: Path) -> Result:
    """The run in the SQLite store, through ``MlflowClient`` and ``mlflow.artifacts``."""
    import mlflow
    from mlflow.tracking import MlflowClient

    result = _empty()
    client = MlflowClient(tracking_uri=f"sqlite:///{directory / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(PROJECT)
    runs = client.search_runs([experiment.experiment_id])
    result["runs"] = len(runs)
    run = _one(runs, "MLflow run")
    run_id = run.info.run_id
    result["config"] = dict(run.data.params)
    for key in run.data.metrics:
        history = client.get_metric_history(run_id, key)
        result["metrics"][key] = sorted((metric.step, metric.value) for metric in history)
    root = Path(client.download_artifacts(run_id, "", str(directory / "downloaded")))
    for image in sorted(root.glob("images/*.png")):
        key = image.name.split("+step+")[0]  # mlflow.log_image names "<key>+step+<n>+..."
        result["images"].setdefault(key, []).append(_size(image))
    for artifact in client.list_artifacts(run_id):
        if artifact.path.endswith(".json"):
            table = mlflow.artifacts.load_dict(f"{run.info.artifact_uri}/{artifact.path}")
            name = artifact.path.removesuffix(".json").removesuffix(f"_step{LAST_STEP}")
            result["tables"][name] = [table["columns"], *table["data"]]
    return result


# --- Comet ----------------------------------------------------------------------------------


def _comet_setup(directory: Path) -> tuple[dict[str, Any], dict[str, str]]:
    offline = directory / "comet"
    offline.mkdir()
    return {"online": False}, {"COMET_OFFLINE_DIRECTORY": str(offline)}


def read_comet(directory: Path) -> Result:
    """The offline experiment's archive (what ``comet upload`` sends): ``messages.json``."""
    from comet_ml.messages import MetricMessage, ParameterMessage, UploadFileMessage

    result = _empty()
    archives = sorted((directory / "comet").glob("*.zip"))
    result["runs"] = len(archives)
    with zipfile.ZipFile(_one(archives, "Comet archive")) as archive:
        for line in archive.read("messages.json").decode("utf-8").splitlines():
            message = json.loads(line)
            payload = message["payload"]
            if message["type"] == ParameterMessage.type:
                param = payload["param"]
                if param["paramName"] != "curr_step":
                    result["config"][param["paramName"]] = param["paramValue"]
            elif message["type"] == MetricMessage.type:
                metric = payload["metric"]
                if metric["metricName"] in METRICS:  # not Comet's system metrics
                    result["metrics"].setdefault(metric["metricName"], []).append(
                        (metric["step"], metric["metricValue"])
                    )
            elif message["type"] == UploadFileMessage.type:
                content = archive.read(payload["file_path"])
                details = payload["additional_params"]
                if payload["upload_type"] == "visualization":  # what log_image uploads
                    result["images"].setdefault(details["figName"], []).append(_size(content))
                elif details.get("fileName", "").endswith(".csv"):
                    rows = list(csv.reader(io.StringIO(content.decode("utf-8"))))
                    name = details["fileName"].removesuffix(".csv")
                    header, *body = rows
                    result["tables"][name] = [header, *[[int(a), b] for a, b in body]]
    return result


# --- Aim ------------------------------------------------------------------------------------


def _aim_setup(directory: Path) -> tuple[dict[str, Any], dict[str, str]]:
    # the repository is the Accelerator's logging dir; no system metrics thread
    return {"system_tracking_interval": None, "capture_terminal_logs": False}, {}


def read_aim(directory: Path) -> Result:
    """The run in the Aim repository, through ``aim.Repo`` (indexed as ``aim up`` does)."""
    from aim import Repo
    from aim.sdk.index_manager import RepoIndexManager
    from aim.storage.context import Context

    result = _empty()
    repo = Repo.from_path(str(directory))
    hashes = repo.list_all_runs()
    result["runs"] = len(hashes)
    indexer = RepoIndexManager.get_index_manager(repo)
    for run_hash in hashes:
        indexer.index(run_hash)
    repo.container_pool.clear()  # reopen the index just written
    run = _one(list(repo.iter_runs()), "indexed Aim run")
    assert run.name == PROJECT, run.name
    result["config"] = run["hparams"]
    for metric in run.metrics():
        if not metric.name.startswith("__system__"):
            result["metrics"][metric.name] = [
                (step, value) for step, (value, *_rest) in metric.data.items()
            ]
    images = run.get_image_sequence("sample", Context({}))
    for _step, (tracked, *_rest) in images.data.items():
        batch = tracked if isinstance(tracked, list) else [tracked]
        result["images"]["sample"] = [
            (image.to_pil_image().height, image.to_pil_image().width) for image in batch
        ]
    return result


# --- ClearML --------------------------------------------------------------------------------


def _clearml_setup(directory: Path) -> tuple[dict[str, Any], dict[str, str]]:
    init = {"auto_connect_frameworks": False, "auto_resource_monitoring": False}
    return init, {"CLEARML_CACHE_DIR": str(directory / "clearml")}


def _clearml_prepare() -> None:
    """Keep ClearML out of the checkout's git repository.

    Task.init detects the repository of the calling file (this checkout) in a thread that
    ``Task.close`` waits for, running ``git`` there; a busy checkout made that wait outlast
    the run's timeout once. ClearML's documented switch stores the script alone instead.
    """
    from clearml import Task

    Task.force_store_standalone_script(True)


def read_clearml(directory: Path) -> Result:
    """The offline session folder: ``task.json`` (HOCON config) and ``metrics.jsonl``."""
    from clearml.utilities.pyhocon import ConfigFactory, HOCONConverter

    result = _empty()
    sessions = [path for path in (directory / "clearml" / "offline").iterdir() if path.is_dir()]
    result["runs"] = len(sessions)
    session = _one(sessions, "ClearML offline session")
    task = json.loads((session / "task.json").read_text())
    assert task["name"] == PROJECT, task["name"]
    text = task["configuration"]["General"]["value"]
    result["config"] = json.loads(HOCONConverter.to_json(ConfigFactory.parse_string(text)))
    for line in (session / "metrics.jsonl").read_text().splitlines():
        for event in json.loads(line):
            if event["type"] == "training_stats_scalar":
                result["metrics"].setdefault(event["metric"], []).append(
                    (event["iter"], event["value"])
                )
            elif event["type"] == "training_debug_image":
                result["images"].setdefault(event["metric"], []).append(_size(event["url"]))
            elif event["type"] == "plot":
                plot = json.loads(event["plot_str"])["data"][0]
                columns = plot["cells"]["values"]
                rows = [list(row) for row in zip(*columns, strict=True)]
                result["tables"][event["metric"]] = [plot["header"]["values"], *rows]
    return result


# --- DVCLive --------------------------------------------------------------------------------


def _dvclive_setup(directory: Path) -> tuple[dict[str, Any], dict[str, str]]:
    # no DVC experiment and no dvc.yaml: nothing outside the folder (the checkout is a git repo)
    return {"dir": str(directory / "dvclive"), "save_dvc_exp": False, "dvcyaml": None}, {}


def read_dvclive(directory: Path) -> Result:
    """DVCLive's folder, through ``dvclive.serialize`` / ``dvclive.utils`` readers."""
    from dvclive.serialize import load_yaml
    from dvclive.utils import parse_tsv

    result = _empty()
    live = directory / "dvclive"
    result["runs"] = int((live / "params.yaml").is_file())
    result["config"] = load_yaml(live / "params.yaml")
    for table in sorted((live / "plots" / "metrics").glob("*.tsv")):
        rows = parse_tsv(table)
        result["metrics"][table.stem] = [(int(row["step"]), float(row[table.stem])) for row in rows]
    for image in sorted((live / "plots" / "images").glob("*.png")):
        result["images"].setdefault(image.stem, []).append(_size(image))
    return result


# --- SwanLab --------------------------------------------------------------------------------


def _swanlab_setup(directory: Path) -> tuple[dict[str, Any], dict[str, str]]:
    return {"mode": "offline", "log_dir": str(directory / "swanlog")}, {}


def read_swanlab(directory: Path) -> Result:
    """The offline run: its ``.swanlab`` record log (SwanLab's own reader), config, media."""
    import yaml
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    result = _empty()
    runs = sorted((directory / "swanlog").glob("run-*"))
    result["runs"] = len(runs)
    run = _one(runs, "SwanLab run")
    config = yaml.safe_load((run / "files" / "config.yaml").read_text(encoding="utf-8"))
    result["config"] = {key: entry["value"] for key, entry in config.items()}
    reader = DataStoreReader()
    reader.open(_one(list(run.glob("run-*.swanlab")), ".swanlab file"))
    for raw in reader:
        record = Record()
        record.ParseFromString(raw)
        if record.HasField("start"):
            assert record.start.project == PROJECT, record.start.project
        elif record.HasField("scalar"):
            scalar = record.scalar
            result["metrics"].setdefault(scalar.key, []).append((scalar.step, scalar.value.number))
        elif record.HasField("media"):
            media = record.media
            for item in media.value.items:
                (path,) = run.glob(f"media/*/{item.filename}")
                if path.suffix == ".png":
                    result["images"].setdefault(media.key, []).append(_size(path))
                else:  # an ECharts table: {"colDefs": [{"field": ...}], "rowData": [{...}]}
                    table = json.loads(path.read_text(encoding="utf-8"))
                    header = [column["field"] for column in table["colDefs"]]
                    rows = [[row[column] for column in header] for row in table["rowData"]]
                    result["tables"][media.key] = [header, *rows]
    return result


# --- Trackio --------------------------------------------------------------------------------


def _trackio_setup(directory: Path) -> tuple[dict[str, Any], dict[str, str]]:
    return {}, {"TRACKIO_DIR": str(directory / "trackio")}


def read_trackio(directory: Path) -> Result:
    """The project's SQLite store under ``TRACKIO_DIR``, through ``trackio``'s own storage API."""
    from trackio.sqlite_storage import SQLiteStorage

    result = _empty()
    runs = SQLiteStorage.get_runs(PROJECT)
    result["runs"] = len(runs)
    run = _one(runs, "Trackio run")
    result["config"] = SQLiteStorage.get_run_config(PROJECT, run) or {}
    media = directory / "trackio" / "media"
    for row in SQLiteStorage.get_logs(PROJECT, run):
        for key, value in row.items():
            if key in ("step", "timestamp"):
                continue
            kind = value.get("_type") if isinstance(value, dict) else None
            if kind == "trackio.image":
                result["images"].setdefault(key, []).append(_size(media / value["file_path"]))
            elif kind == "trackio.table":
                records = value["_value"]
                header = list(records[0])
                result["tables"][key] = [header, *[[rec[col] for col in header] for rec in records]]
            else:
                result["metrics"].setdefault(key, []).append((row["step"], value))
    return result


# --- the cases ------------------------------------------------------------------------------

_TEXT_CONFIG = {key: str(value) for key, value in CONFIG.items()}  # MLflow's params are text
_FLAT_COMET = {key: value for key, value in CONFIG.items() if key != "schedule"} | {
    "schedule|kind": "cosine",
    "schedule|warmup": 10,
}

CASES.update(
    {
        "jsonl": Case("json", _jsonl_setup, read_jsonl, False, False, CONFIG),
        "tensorboard": Case(
            "tensorboard",
            _tensorboard_setup,
            read_tensorboard,
            True,
            False,  # no table type in TensorBoard's tracker (nor in Accelerate's)
            {
                "hparams": {key: value for key, value in CONFIG.items() if key != "schedule"}
                | {"schedule/kind": "cosine", "schedule/warmup": 10},
                "hparams.yml": CONFIG,
            },
        ),
        "wandb": Case("wandb", _wandb_setup, read_wandb, True, True, CONFIG),
        "mlflow": Case("mlflow", _mlflow_setup, read_mlflow, True, True, _TEXT_CONFIG),
        "comet_ml": Case("comet_ml", _comet_setup, read_comet, True, True, _FLAT_COMET),
        # Aim has no table object: its tracker (as Accelerate's) has no log_table
        "aim": Case("aim", _aim_setup, read_aim, True, False, CONFIG),
        "clearml": Case(
            "clearml", _clearml_setup, read_clearml, True, True, CONFIG, _clearml_prepare
        ),
        # DVCLive has no table type (plots are x/y data): no log_table, as in Accelerate
        "dvclive": Case("dvclive", _dvclive_setup, read_dvclive, True, False, CONFIG),
        "swanlab": Case("swanlab", _swanlab_setup, read_swanlab, True, True, CONFIG),
        "trackio": Case("trackio", _trackio_setup, read_trackio, True, True, CONFIG),
    }
)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_two_process_run_reads_back_from_the_library_files(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    _require(case.module)
    directory = tmp_path / "run"
    directory.mkdir()
    init_kwargs, env = case.setup(directory)
    env = {**_environment(tmp_path), **env}
    ranks = run_on_cpu(
        _log_a_run, name, str(directory), init_kwargs, world_size=2, timeout=RUN_TIMEOUT, env=env
    )
    # the tracker exists on the main process only
    assert ranks == [
        {"main": True, "started": [_tracker_class(name)]},
        {"main": False, "started": []},
    ]
    (found,) = run_on_cpu(_read_back, name, str(directory), world_size=1, timeout=120, env=env)
    _check(name, found)


def _tracker_class(name: str) -> str:
    from accel.tracking import LOGGER_TYPE_TO_CLASS

    return LOGGER_TYPE_TO_CLASS[name].__name__


def test_log_with_all_takes_every_installed_tracker(tmp_path: Path) -> None:
    """``log_with="all"``: every built-in tracker whose library is installed, none left out."""
    from accel.tracking import filter_trackers

    installed = [name for name, case in CASES.items() if importlib.util.find_spec(case.module)]
    if len(installed) < len(CASES):
        _require(next(c.module for c in CASES.values() if not importlib.util.find_spec(c.module)))
    assert sorted(filter_trackers("all", tmp_path)) == sorted(CASES)
