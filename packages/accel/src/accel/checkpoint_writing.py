"""Writing checkpoints: synchronously, or captured now and written in the background.

The layout, the crash-safety protocol and the checks that loading runs are described in
:mod:`accel.checkpointing`. A save runs in three phases, on every process at the same point:

1. *Prepare* (caller's thread): the destination is checked, the scheduler and custom states
   are serialised (a state that ``load_state`` would refuse is refused here), the engine
   synchronises, and the processes create the hidden ``.<name>.incomplete`` directory.
2. *Capture* (caller's thread): the model state dicts (after the save pre-hooks), the
   optimizer, loader, scaler and random states and any partial gradients become a list of
   :class:`PlannedFile`. A synchronous save writes them now; an asynchronous one
   (``async_save=True``) copies them into host memory first
   (:class:`~accel.async_save.HostSnapshot`) and returns.
3. *Write and commit*: every file is written and fsynced; once every process is done, the
   main process writes the manifest, renames the directory into place and prunes beyond
   ``total_limit``. Asynchronously this runs on the writer thread
   (:class:`~accel.async_save.BackgroundSaver`), with the same files, in the same order, so
   the checkpoint is byte-identical to a synchronous save of the same state.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from accel_state import PartialState, gather_object
from accel_state.files import fsync_directory, fsync_file
from accel_state.safetensors_writer import write_safetensors
from accel_state.serialization import clean_state_dict_for_safetensors, serialize_loadable

from .checkpoint_resume import collect_gradients, rng_state
from .checkpointing import (
    CUSTOM_NAME,
    DATALOADER_NAME,
    GRADIENTS_NAME,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    MODEL_NAME,
    OPTIMIZER_NAME,
    RNG_STATE_NAME,
    SAFE_MODEL_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
    indexed_name,
    is_checkpoint,
    numbered_checkpoints,
)

if TYPE_CHECKING:
    from .async_save import BackgroundSaver
    from .run_state import RunState

__all__ = ["PlannedFile", "save_state"]

logger = logging.getLogger("accel.checkpointing")


def _torch_save(obj: Any, path: Path) -> None:
    torch.save(obj, path)
    fsync_file(path)


def _write_bytes(payload: bytes, path: Path) -> None:
    path.write_bytes(payload)
    fsync_file(path)


def _small_states(run: RunState) -> dict[str, bytes]:
    """The scheduler and custom-object states, serialised, by file name.

    Each is checked to load back under ``weights_only=True`` (numpy values included), so a
    state that ``load_state`` would refuse is refused here, on every process, before any
    file is written.
    """
    payloads = {}
    for index, scheduler in enumerate(run.schedulers):
        payloads[indexed_name(SCHEDULER_NAME, index, ".bin")] = serialize_loadable(
            scheduler.state_dict(),
            f"save_state: scheduler {index} ({type(scheduler).__name__}).state_dict()",
        )
    for index, obj in enumerate(run.custom_objects):
        payloads[f"{CUSTOM_NAME}_{index}.pkl"] = serialize_loadable(
            obj.state_dict(),
            f"save_state: registered object {index} ({type(obj).__name__}).state_dict()",
        )
    return payloads


def _save_weights(state_dict: dict[str, Any], path: Path, safe: bool) -> None:
    if safe:
        # The same bytes as safetensors.torch.save_file, written without holding the GIL
        # (a background write then leaves the training loop's Python alone); fsynced.
        tensors = {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
        write_safetensors(path, clean_state_dict_for_safetensors(tensors), {"format": "pt"})
    else:
        _torch_save(state_dict, path)


def _window_open(run: RunState) -> bool:
    return run.gradient_state.window_open


@dataclasses.dataclass
class PlannedFile:
    """One file of a checkpoint: its name, how it is written and what goes in it.

    ``kind`` is ``"torch"`` (``torch.save``), ``"safetensors"`` (tensors only) or ``"bytes"``
    (already serialised).
    """

    name: str
    kind: str
    payload: Any


def _plan_process_files(
    run: RunState,
    model_states: Sequence[dict[str, Any] | None],
    safe_serialization: bool,
    shared: bool,
    small_states: dict[str, bytes],
    own_layout: bool = True,
) -> list[PlannedFile]:
    """This process's files of a checkpoint, in the order they are written.

    With ``shared`` (see :func:`_writes_shared_files`) the weights, optimizer, data-loader
    and scaler states and ``small_states`` (see :func:`_small_states`); on every process its
    random states (and, in the middle of an accumulation window, its partial gradients).
    """
    files: list[PlannedFile] = []
    if shared and own_layout:
        for index, weights in enumerate(model_states):
            if weights is None:
                continue  # a pre-hook took this model over
            if safe_serialization:
                name, kind = indexed_name(SAFE_MODEL_NAME, index, ".safetensors"), "safetensors"
            else:
                name, kind = indexed_name(MODEL_NAME, index, ".bin"), "torch"
            files.append(PlannedFile(name, kind, weights))
        for index, optimizer in enumerate(run.optimizers):
            name = indexed_name(OPTIMIZER_NAME, index, ".bin")
            files.append(PlannedFile(name, "torch", optimizer.state_dict()))
    if shared:
        for index, loader in enumerate(run.dataloaders):
            if callable(getattr(loader, "state_dict", None)):
                name = indexed_name(DATALOADER_NAME, index, ".bin")
                files.append(PlannedFile(name, "torch", loader.state_dict()))
        if run.scaler is not None:
            files.append(PlannedFile(SCALER_NAME, "torch", run.scaler.state_dict()))
        for name, payload in small_states.items():
            files.append(PlannedFile(name, "bytes", payload))
    rank = PartialState().process_index
    files.append(PlannedFile(f"{RNG_STATE_NAME}_{rank}.pkl", "torch", rng_state(run)))
    if _window_open(run):
        grads = collect_gradients(run)
        if grads:
            files.append(PlannedFile(f"{GRADIENTS_NAME}_{rank}.safetensors", "safetensors", grads))
    return files


def _write_files(directory: Path, files: Sequence[PlannedFile]) -> None:
    """Write (and fsync) every planned file into ``directory``."""
    for file in files:
        path = directory / file.name
        if file.kind == "safetensors":
            _save_weights(file.payload, path, True)
        elif file.kind == "torch":
            _torch_save(file.payload, path)
        else:
            _write_bytes(file.payload, path)


def _writes_shared_files(run: RunState, directory: Path) -> bool:
    """Whether this process writes the files of ``directory`` that are not per process.

    The main process does (and each node's local main with ``save_on_each_node``). When the
    processes name different folders (each its own temporary directory, say), every folder
    gets a complete checkpoint: the lowest process naming it writes those files there.
    Called by every process at the same point (a collective when processes name folders).
    """
    state = PartialState()
    config = run.project_configuration
    own = os.fspath(directory.absolute())
    folders = _folders_of_processes(own)
    if len(set(folders)) > 1 and folders.index(own) == state.process_index:
        return True
    return state.is_main_process or (config.save_on_each_node and state.is_local_main_process)


def _folders_of_processes(folder: str) -> list[str]:
    """The folder each process names, in rank order (just ``[folder]`` without a group)."""
    state = PartialState()
    if state.num_processes == 1 or not torch.distributed.is_initialized():
        return [folder]
    return [str(entry) for entry in gather_object([folder])]


def _write_manifest(directory: Path) -> None:
    files = {
        entry.relative_to(directory).as_posix(): {"size": entry.stat().st_size}
        for entry in sorted(directory.rglob("*"))
        if entry.is_file() and entry.name != MANIFEST_NAME
    }
    manifest = {"format": MANIFEST_FORMAT, "written_by": "accel", "files": files}
    path = directory / MANIFEST_NAME
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    fsync_file(path)


def _commit(temporary: Path, final: Path) -> None:
    """Rename the finished temporary directory to its final name, durably."""
    fsync_directory(temporary)
    if final.exists():
        # An explicit directory saved again: move the old one aside, then drop it.
        retired = final.with_name(f".{final.name}.replaced")
        if retired.exists():
            shutil.rmtree(retired)
        os.replace(final, retired)
        os.replace(temporary, final)
        fsync_directory(final.parent)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(temporary, final)
        fsync_directory(final.parent)


def _prune(base: Path, total_limit: int | None) -> None:
    for stale in base.glob(".checkpoint_*.incomplete"):
        shutil.rmtree(stale, ignore_errors=True)
    if total_limit is None:
        return
    checkpoints = numbered_checkpoints(base)
    for _, path in checkpoints[: max(0, len(checkpoints) - total_limit)]:
        logger.info(f"Deleting {path}: more than total_limit={total_limit} checkpoints")
        shutil.rmtree(path)


def _check_replaceable(final: Path) -> None:
    """Refuse an existing directory that a save would replace but that is not a checkpoint.

    A new checkpoint replaces the old one as a whole; a directory holding other files (or the
    working directory, or one of its parents) must never be deleted by that.
    """
    if not final.is_dir():
        return
    resolved, here = final.resolve(), Path.cwd().resolve()
    if resolved == here or resolved in here.parents:
        raise ValueError(
            f"save_state(output_dir={os.fspath(final)!r}) is the working directory or one of "
            "its parents: save into a dedicated sub-directory such as 'checkpoint'"
        )
    if any(final.iterdir()) and not is_checkpoint(final):
        raise ValueError(
            f"save_state(output_dir={os.fspath(final)!r}) already holds files that are not an "
            "accel or Accelerate checkpoint; saving would replace the directory as a whole. "
            "Choose a new or empty directory"
        )


def _finish(run: RunState, temporary: Path, final: Path) -> None:
    """Manifest, rename into place, and prune beyond ``total_limit`` (the committing process)."""
    config = run.project_configuration
    _write_manifest(temporary)
    _commit(temporary, final)
    if config.automatic_checkpoint_naming:
        _prune(final.parent, config.total_limit)


def _destination(run: RunState, output_dir: str | os.PathLike[str] | None) -> Path:
    """The checkpoint directory a save writes, checked."""
    config = run.project_configuration
    if config.automatic_checkpoint_naming:
        if run.project_dir is None:
            raise ValueError(
                "save_state: automatic_checkpoint_naming needs a project directory; pass "
                "project_dir= to the Accelerator or to ProjectConfiguration"
            )
        final = Path(run.project_dir) / "checkpoints" / f"checkpoint_{config.iteration}"
        if final.exists():
            raise ValueError(
                f"Checkpoint directory {final} ({config.iteration}) already exists. Set "
                "accelerator.project_configuration.iteration to the next free number"
            )
        return final.absolute()
    if output_dir is None:
        raise ValueError(
            "save_state(output_dir=None): pass a directory, or enable "
            "ProjectConfiguration(automatic_checkpoint_naming=True) with a project_dir"
        )
    final = Path(output_dir)
    if final.exists() and not final.is_dir():
        raise ValueError(f"save_state(output_dir={os.fspath(output_dir)!r}) is a file")
    _check_replaceable(final)
    return final.absolute()


def save_state(
    run: RunState,
    output_dir: str | os.PathLike[str] | None = None,
    safe_serialization: bool = True,
    background: BackgroundSaver | None = None,
) -> str:
    """Write a complete checkpoint of the run (see ``Accelerator.save_state``).

    With ``background`` the state is captured into its host snapshot and written by its
    thread; the call returns once the capture is done.
    """
    config = run.project_configuration
    final = _destination(run, output_dir)
    layout = run.engine.checkpoint_layout()
    if background is not None and layout is not None and not layout.writes_in_background:
        raise ValueError(
            f"save_state(async_save=True): the {run.engine.name} engine stores its models in "
            "its own layout, which accel writes only synchronously so far; pass "
            "async_save=False (or ProjectConfiguration(async_save=False))"
        )
    if layout is not None:
        layout.check_save(_window_open(run))
    run.engine.synchronize()
    temporary = final.with_name(f".{final.name}.incomplete")
    small_states = _small_states(run)
    writer = _writes_shared_files(run, final)
    if writer:
        if temporary.exists():
            shutil.rmtree(temporary)
        temporary.mkdir(parents=True)
    run.wait_for_everyone()

    model_states: list[dict[str, Any] | None] = (
        [run.engine.model_state_dict(model) if writer else {} for model in run.models]
        if layout is None
        else []
    )
    for hook in list(run.save_pre_hooks):
        hook(list(run.models), model_states, os.fspath(temporary))
    captured_layout = None
    if layout is not None:
        if background is None:
            layout.save(run.models, run.optimizers, temporary)
        else:
            captured_layout = layout.capture(run.models, run.optimizers)
    files = _plan_process_files(
        run, model_states, safe_serialization, writer, small_states, layout is None
    )
    if background is not None:
        states = {file.name: file.payload for file in files}
        if captured_layout is not None:
            states.update({f"layout/{k}": v for k, v in captured_layout.states.items()})
        captured = background.snapshot.capture(states)
        snapshot = [dataclasses.replace(file, payload=captured[file.name]) for file in files]

        def write(group: Any) -> None:
            if captured_layout is not None:  # first, as a synchronous save does
                copies = {k: captured[f"layout/{k}"] for k in captured_layout.states}
                captured_layout.write(temporary, copies, group)
            _write_files(temporary, snapshot)

        background.submit(
            os.fspath(final), write, lambda: _finish(run, temporary, final) if writer else None
        )
        config.iteration += 1
        logger.info(f"Captured the training state; writing {final} in the background")
        return os.fspath(final)
    _write_files(temporary, files)
    run.wait_for_everyone()
    if writer:
        _finish(run, temporary, final)
    run.wait_for_everyone()
    config.iteration += 1
    logger.info(f"Saved the training state to {final}")
    return os.fspath(final)
