"""Checkpoints of a training run: Accelerate's layout, written crash-safely, loaded with checks.

This module holds the layout and the loading; :mod:`accel.checkpoint_writing` writes
checkpoints (synchronously or in the background).

A checkpoint is a directory with Accelerate 1.15's file names (``model.safetensors``,
``optimizer.bin``, ``scheduler.bin``, ``dl_state_dict.bin``, ``scaler.pt``,
``random_states_<rank>.pkl``, ``custom_checkpoint_<i>.pkl``), so checkpoints move both ways
between Accelerate and accel. On top of that layout:

* Crash safety. Every process writes into a hidden sibling ``.<name>.incomplete``; after all
  files are written and fsynced, the main process writes ``accel_manifest.json`` (every file
  with its size) last, fsyncs the directory and renames it to its final name. A process
  killed at any moment leaves either the previous checkpoints alone or a hidden directory
  that nothing loads (the next save removes it). ``total_limit`` pruning runs only after the
  new checkpoint is complete.
* Integrity. ``load_state`` checks the manifest (missing or truncated files), the safetensors
  headers, the number of custom objects and the tensor names and shapes *before* it changes
  anything, and names the file or tensor at fault.
* Exact resume. Besides Accelerate's RNG states, the random-state files hold the gradient
  accumulation counters, and a checkpoint taken in the middle of an accumulation window
  also holds the partial gradients (``accel_gradients_<rank>.safetensors``), so training
  continues bit for bit (their content: :mod:`accel.checkpoint_resume`).
* Safety. Every pickle is read with ``weights_only=True``; a file that needs more is refused.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from accel_state import PartialState
from accel_state.files import atomic_write
from accel_state.safetensors_header import SafetensorsHeaderError, read_safetensors_header
from accel_state.serialization import load as _safe_load
from accel_state.serialization import serialize_loadable

from .checkpoint_resume import restore_resume_states

if TYPE_CHECKING:
    from .run_state import RunState

__all__ = ["CheckpointError", "load_custom_state", "save_custom_state"]

logger = logging.getLogger("accel.checkpointing")

MODEL_NAME = "pytorch_model"
SAFE_MODEL_NAME = "model"
OPTIMIZER_NAME = "optimizer"
SCHEDULER_NAME = "scheduler"
DATALOADER_NAME = "dl_state_dict"
SCALER_NAME = "scaler.pt"
RNG_STATE_NAME = "random_states"
CUSTOM_NAME = "custom_checkpoint"
GRADIENTS_NAME = "accel_gradients"
MANIFEST_NAME = "accel_manifest.json"
MANIFEST_FORMAT = 1
_CHECKPOINT_DIR = re.compile(r"^checkpoint_(\d+)$")
_CUSTOM_FILE = re.compile(rf"^{CUSTOM_NAME}_(\d+)\.pkl$")
# Any file that save_state (accel's or Accelerate's) writes.
_CHECKPOINT_FILE = re.compile(
    r"^(?:(?:model|pytorch_model|optimizer|scheduler|dl_state_dict|sampler)(?:_\d+)?"
    r"\.(?:safetensors|bin)|random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl|scaler\.pt|"
    r"accel_manifest\.json)$"
)
_MODULE_PREFIXES = ("module.", "_orig_mod.")


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete, corrupt, or does not match what was prepared."""


def indexed_name(name: str, index: int, ext: str) -> str:
    """``name`` + ``ext`` for the first object, ``name_<index>`` + ``ext`` for the others."""
    return f"{name}{ext}" if index == 0 else f"{name}_{index}{ext}"


# --------------------------------------------------------------------------------------------
# Custom objects and the numbered checkpoints
# --------------------------------------------------------------------------------------------


def save_custom_state(
    obj: Any, path: str | os.PathLike[str], index: int = 0, save_on_each_node: bool = False
) -> None:
    """Save ``obj.state_dict()`` as ``custom_checkpoint_<index>.pkl`` in ``path`` (main only)."""
    state = PartialState()
    payload = serialize_loadable(
        obj.state_dict(), f"save_custom_state: {type(obj).__name__}.state_dict()"
    )
    if state.is_main_process or (save_on_each_node and state.is_local_main_process):
        atomic_write(Path(path) / f"{CUSTOM_NAME}_{index}.pkl", payload)


def load_custom_state(obj: Any, path: str | os.PathLike[str], index: int = 0) -> None:
    """Load ``custom_checkpoint_<index>.pkl`` from ``path`` into ``obj``."""
    file = Path(path) / f"{CUSTOM_NAME}_{index}.pkl"
    obj.load_state_dict(_read_pickle(file, "cpu"))


def numbered_checkpoints(base: Path) -> list[tuple[int, Path]]:
    """The complete ``checkpoint_<n>`` directories under ``base``, oldest first."""
    if not base.is_dir():
        return []
    found = []
    for entry in base.iterdir():
        match = _CHECKPOINT_DIR.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def is_checkpoint(directory: Path) -> bool:
    """Whether ``directory`` holds an accel or Accelerate checkpoint's files."""
    return (directory / MANIFEST_NAME).exists() or any(directory.glob(f"{RNG_STATE_NAME}_*.pkl"))


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def _read_pickle(path: Path, map_location: Any) -> Any:
    try:
        return _safe_load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except Exception as error:  # torch raises UnpicklingError, RuntimeError, ...
        if "weights_only" in str(error) or "Unsupported global" in str(error):
            raise CheckpointError(
                f"refusing to load {path}: it holds objects other than tensors and plain "
                "containers, which could run code when unpickled (loaded with "
                "weights_only=True). Re-create the checkpoint, or load the file yourself if "
                "you trust it"
            ) from error
        raise CheckpointError(f"{path} is corrupt or unreadable: {error}") from error


def _latest_checkpoint(run: RunState) -> Path:
    if run.project_dir is None:
        raise ValueError("load_state(): no input_dir and no project_dir to search")
    base = Path(run.project_dir) / "checkpoints"
    checkpoints = numbered_checkpoints(base)
    if not checkpoints:
        raise ValueError(f"load_state(): no complete checkpoint_<n> directory in {base}")
    return checkpoints[-1][1]


def _refuse_non_checkpoint(directory: Path) -> None:
    """Refuse a folder holding none of the files a checkpoint consists of."""
    names = sorted(entry.name for entry in directory.iterdir())
    if any(_CHECKPOINT_FILE.match(name) for name in names):
        return
    if names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        held = (
            f"it holds {shown} but none of the files save_state writes (accel_manifest.json, "
            "random_states_<rank>.pkl, model.safetensors, ...)"
        )
    else:
        held = "it is empty"
    raise CheckpointError(
        f"load_state(input_dir={os.fspath(directory)!r}) is not a checkpoint: {held}. Pass a "
        "folder that save_state (accel's or Accelerate's) wrote"
    )


def verify_checkpoint(directory: Path) -> None:
    """Check that ``directory`` is a checkpoint whose files match its manifest.

    Raises:
        CheckpointError: it is not a checkpoint, or a file is missing or has another size.
    """
    _refuse_non_checkpoint(directory)
    _verify_manifest(directory)


def _verify_manifest(directory: Path) -> None:
    path = directory / MANIFEST_NAME
    if not path.exists():
        return  # written by Accelerate: nothing to check against
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{path} is corrupt: {error}") from error
    for name, entry in sorted(files.items()):
        file = directory / name
        if not file.exists():
            raise CheckpointError(f"{file} is missing (listed in {MANIFEST_NAME})")
        size = file.stat().st_size
        if size != entry.get("size"):
            raise CheckpointError(
                f"{file} has {size} bytes, {MANIFEST_NAME} recorded {entry.get('size')}: the "
                "file was truncated or changed after the checkpoint was written"
            )


def _weights_file(directory: Path, index: int) -> Path:
    for name, ext in ((SAFE_MODEL_NAME, ".safetensors"), (MODEL_NAME, ".bin")):
        candidate = directory / indexed_name(name, index, ext)
        if candidate.exists():
            return candidate
    raise CheckpointError(
        f"{directory} has no weights for model {index} "
        f"({indexed_name(SAFE_MODEL_NAME, index, '.safetensors')} or "
        f"{indexed_name(MODEL_NAME, index, '.bin')})"
    )


def _read_weights(path: Path, map_location: Any) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        try:
            read_safetensors_header(path)
        except SafetensorsHeaderError as error:
            raise CheckpointError(f"{path} is corrupt: {error.problem}") from None
        except OSError as error:
            raise CheckpointError(
                f"{path} is corrupt: unreadable safetensors header ({error})"
            ) from error
        from safetensors.torch import load_file

        device = "cpu" if map_location is None else map_location
        try:
            return dict(load_file(path, device=device))
        except Exception as error:
            raise CheckpointError(f"{path} is corrupt: {error}") from error
    loaded = _read_pickle(path, map_location)
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{path} does not hold a state dict")
    return loaded


def _match_keys(
    loaded: dict[str, torch.Tensor], expected: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """Rename ``loaded`` keys across DDP / compile prefixes to match ``expected``."""
    if set(loaded) <= set(expected):
        return loaded

    def strip(key: str) -> str:
        changed = True
        while changed:
            changed = False
            for prefix in _MODULE_PREFIXES:
                if key.startswith(prefix):
                    key, changed = key[len(prefix) :], True
        return key

    by_bare = {strip(key): key for key in expected}
    renamed = {}
    for key, value in loaded.items():
        renamed[by_bare.get(strip(key), key)] = value
    return renamed


def _alias_key(tensor: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    """Tensors with equal keys are the same memory (tied weights)."""
    return (
        tensor.untyped_storage().data_ptr(),
        int(tensor.storage_offset()),
        tuple(tensor.shape),
    )


def _check_weights(
    path: Path, loaded: dict[str, torch.Tensor], model: torch.nn.Module
) -> dict[str, torch.Tensor]:
    expected = model.state_dict()
    loaded = _match_keys(loaded, expected)
    unexpected = sorted(set(loaded) - set(expected))
    if unexpected:
        raise CheckpointError(
            f"{path} holds tensors the model does not have: {unexpected[:5]}"
            + (" ..." if len(unexpected) > 5 else "")
        )
    storages: dict[tuple[int, int, tuple[int, ...]], str] = {}
    for key, value in expected.items():
        if isinstance(value, torch.Tensor) and key in loaded:
            storages[_alias_key(value)] = key
    for key, value in expected.items():
        if not isinstance(value, torch.Tensor):
            continue
        if key not in loaded:
            tied = storages.get(_alias_key(value))
            if tied is None:
                raise CheckpointError(f"{path} lacks tensor {key!r} of the model")
            continue
        if tuple(loaded[key].shape) != tuple(value.shape):
            raise CheckpointError(
                f"{path}: tensor {key!r} has shape {tuple(loaded[key].shape)} in the "
                f"checkpoint but {tuple(value.shape)} in the model (a checkpoint of another "
                "model?)"
            )
    return loaded


def _check_optimizer(path: Path, loaded: Any, optimizer: Any) -> None:
    if not isinstance(loaded, dict) or "param_groups" not in loaded:
        raise CheckpointError(f"{path} does not hold an optimizer state dict")
    mine = optimizer.state_dict()["param_groups"]
    theirs = loaded["param_groups"]
    sizes_mine = [len(group["params"]) for group in mine]
    sizes_theirs = [len(group["params"]) for group in theirs]
    if sizes_mine != sizes_theirs:
        raise CheckpointError(
            f"{path}: parameter groups of sizes {sizes_theirs} in the checkpoint, "
            f"{sizes_mine} in the prepared optimizer"
        )


@dataclass
class _Loaded:
    """Everything a checkpoint holds for this process, read and checked but not applied."""

    weights: list[dict[str, torch.Tensor]] = field(default_factory=list)
    optimizers: list[Any] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    loaders: list[Any] = field(default_factory=list)
    customs: list[Any] = field(default_factory=list)
    scaler: Any = None
    rng: dict[str, Any] | None = None
    grads: dict[str, torch.Tensor] | None = None
    # Set by a sharded engine's layout: applies its model and optimizer states.
    apply_layout: Callable[[], None] | None = None


def _custom_indices(directory: Path, run: RunState) -> list[int]:
    """The indices of the custom-object files, refused unless one per registered object."""
    customs = sorted(
        int(m.group(1)) for p in directory.iterdir() if (m := _CUSTOM_FILE.match(p.name))
    )
    if len(customs) != len(run.custom_objects):
        raise CheckpointError(
            f"{directory} holds {len(customs)} custom checkpoint(s) but "
            f"{len(run.custom_objects)} object(s) are registered with "
            "register_for_checkpointing(); register the same objects as when saving"
        )
    return customs


def _read_checkpoint(
    directory: Path, run: RunState, models: Sequence[torch.nn.Module], map_location: Any
) -> _Loaded:
    """Read and check every file this process loads, changing nothing."""
    customs = _custom_indices(directory, run)
    loaded = _Loaded()
    layout = run.engine.checkpoint_layout()
    if layout is not None:
        loaded.apply_layout = layout.prepare_load(models, run.optimizers, directory)
    else:
        for index, model in enumerate(models):
            path = _weights_file(directory, index)
            loaded.weights.append(_check_weights(path, _read_weights(path, map_location), model))
        for index, optimizer in enumerate(run.optimizers):
            path = directory / indexed_name(OPTIMIZER_NAME, index, ".bin")
            state = _read_pickle(path, map_location)
            _check_optimizer(path, state, optimizer)
            loaded.optimizers.append(state)
    loaded.schedulers = [
        _read_pickle(directory / indexed_name(SCHEDULER_NAME, i, ".bin"), "cpu")
        for i in range(len(run.schedulers))
    ]
    for index in range(len(run.dataloaders)):
        path = directory / indexed_name(DATALOADER_NAME, index, ".bin")
        loaded.loaders.append(_read_pickle(path, "cpu") if path.exists() else None)
    if run.scaler is not None and (directory / SCALER_NAME).exists():
        loaded.scaler = _read_pickle(directory / SCALER_NAME, "cpu")
    loaded.customs = [_read_pickle(directory / f"{CUSTOM_NAME}_{i}.pkl", "cpu") for i in customs]
    rank = PartialState().process_index
    rng_path = directory / f"{RNG_STATE_NAME}_{rank}.pkl"
    loaded.rng = _read_pickle(rng_path, "cpu") if rng_path.exists() else None
    grads_path = directory / f"{GRADIENTS_NAME}_{rank}.safetensors"
    if grads_path.exists():
        loaded.grads = _read_weights(grads_path, map_location)
        _check_window_world_size(directory)
    return loaded


def _check_window_world_size(directory: Path) -> None:
    """Refuse to resume an open accumulation window at another number of processes."""
    saved_ranks = len(list(directory.glob(f"{RNG_STATE_NAME}_*.pkl")))
    if saved_ranks != PartialState().num_processes:
        raise CheckpointError(
            f"{directory} was saved by {saved_ranks} processes inside an accumulation window "
            f"(its unfinished gradients are in {GRADIENTS_NAME}_<rank>.safetensors), and this "
            f"run has {PartialState().num_processes}: the window cannot be resumed exactly at "
            "another world size. Resume with the number of processes it was saved with, or "
            "load a checkpoint saved at the end of a window"
        )


def _apply_loader_states(directory: Path, run: RunState, states: list[Any]) -> None:
    # A loader checks a state as it applies it (it refuses one of another sampler kind
    # without changing), so loaders go before everything else.
    for index, (loader, state) in enumerate(zip(run.dataloaders, states, strict=True)):
        if state is None:
            continue
        try:
            loader.load_state_dict(state)
        except (ValueError, KeyError, TypeError) as error:
            name = indexed_name(DATALOADER_NAME, index, ".bin")
            raise CheckpointError(
                f"{directory / name} does not fit prepared data loader {index}: {error}"
            ) from error


def _apply_checkpoint(
    directory: Path, run: RunState, models: Sequence[torch.nn.Module], loaded: _Loaded
) -> dict[str, Any]:
    """Load what :func:`_read_checkpoint` read into the prepared objects; return overrides."""
    _apply_loader_states(directory, run, loaded.loaders)
    scaler_state = loaded.scaler
    if loaded.apply_layout is not None:
        if run.scaler is not None and scaler_state is not None:
            # Before the optimizer: loading a sharded optimizer state steps a dummy optimizer.
            run.scaler.load_state_dict(scaler_state)
            scaler_state = None
        loaded.apply_layout()
    else:
        for model, state in zip(models, loaded.weights, strict=True):
            model.load_state_dict(state, strict=False)
        for optimizer, state in zip(run.optimizers, loaded.optimizers, strict=True):
            optimizer.load_state_dict(state)
    for scheduler, state in zip(run.schedulers, loaded.schedulers, strict=True):
        scheduler.load_state_dict(state)
    if scaler_state is not None:
        run.scaler.load_state_dict(scaler_state)
    for obj, state in zip(run.custom_objects, loaded.customs, strict=True):
        obj.load_state_dict(state)
    rng_path = directory / f"{RNG_STATE_NAME}_{PartialState().process_index}.pkl"
    return restore_resume_states(run, loaded.rng, loaded.grads, rng_path)


def _load_checkpoint(
    input_dir: str | os.PathLike[str],
    run: RunState,
    models: Sequence[torch.nn.Module],
    map_location: Any = None,
) -> dict[str, Any]:
    """Check, then load a checkpoint into the prepared objects; return the override attributes.

    Everything is read and checked before anything is changed, so a bad checkpoint leaves
    the models, optimizers and other objects as they were.
    """
    directory = Path(input_dir)
    _verify_manifest(directory)
    if map_location is None:
        map_location = run.device if run.engine.multi_device else "cpu"
    elif map_location == "on_device":
        map_location = run.device
    place = torch.device(map_location)
    # One spelling both readers know: "cpu" (torch.load and safetensors refuse "cpu:0").
    loaded = _read_checkpoint(directory, run, models, "cpu" if place.type == "cpu" else str(place))
    return _apply_checkpoint(directory, run, models, loaded)


def check_map_location(value: Any) -> Any:
    """Return ``value`` if ``load_state`` can load tensors there, else raise.

    Accepted: ``None`` (the default place), ``"cpu"``, ``"on_device"`` (the run's device) and,
    beyond Accelerate, any device torch can name (``"cuda:1"``, ``torch.device(...)``, an index).

    Raises:
        TypeError: anything else (Accelerate's error for it, with the value and the choices).
    """
    if value is None or value in ("cpu", "on_device"):
        return value
    if isinstance(value, (str, int, torch.device)) and not isinstance(value, bool):
        try:
            torch.device(value)
        except (RuntimeError, TypeError, ValueError):
            pass
        else:
            return value
    raise TypeError(
        f"Unsupported optimizer map location passed: map_location={value!r}. Use None (the "
        "run's default), 'cpu', 'on_device' or a device torch can name (e.g. 'cuda:0')."
    )


def load_state(
    run: RunState,
    input_dir: str | os.PathLike[str] | None = None,
    **load_kwargs: Any,
) -> str:
    """Load a checkpoint into the run (see ``Accelerator.load_state``); return its path.

    Raises:
        TypeError: ``map_location`` is not a place tensors can be loaded (before anything
            is read or changed).
    """
    map_location = check_map_location(load_kwargs.pop("map_location", None))
    if input_dir is not None:
        directory = Path(input_dir)
        if not directory.is_dir():
            raise ValueError(f"load_state(input_dir={os.fspath(input_dir)!r}): no such directory")
    elif run.project_configuration.automatic_checkpoint_naming:
        directory = _latest_checkpoint(run)
    else:
        raise ValueError(
            "load_state(input_dir=None): pass the checkpoint directory, or enable "
            "ProjectConfiguration(automatic_checkpoint_naming=True) to load the newest one"
        )
    _refuse_non_checkpoint(directory)
    # Hooks get a copy: one that loads a model itself removes it from this list, and only
    # the models left in it are loaded from the checkpoint's weight files (in order).
    models = list(run.models)
    for hook in list(run.load_pre_hooks):
        hook(models, os.fspath(directory))
    overrides = _load_checkpoint(directory, run, models, map_location=map_location)
    if "step" in overrides:
        run.gradient_state.step = overrides["step"]
    match = _CHECKPOINT_DIR.match(directory.name)
    config = run.project_configuration
    if match and config.automatic_checkpoint_naming and run.project_dir is not None:
        if directory.resolve().parent == (Path(run.project_dir) / "checkpoints").resolve():
            # Continue the numbering after the loaded checkpoint.
            config.iteration = max(config.iteration, int(match.group(1)) + 1)
    logger.info(f"Loaded the training state from {directory}")
    return os.fspath(directory)
