"""The ``Accelerator``'s model and checkpoint methods: state dicts, saving, resuming.

:class:`RunFiles` holds what the Accelerator writes and reads back: the model's full
state dict and inference weights (through the engine, which knows how its models are
sharded), single objects, and whole-run checkpoints (``save_state``/``load_state``, which
:mod:`accel.checkpointing` implements on a :class:`~accel.run_state.RunState`).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from accel_amp import GradientAccumulator
from accel_state.serialization import save as _save

from . import checkpoint_writing, checkpointing
from .async_save import BackgroundSaver
from .auto_resume import (
    Resumed,
    choose_checkpoint,
    loader_position,
    log_skipped,
    skip_numbers_in_use,
)
from .models import has_multi_device_map
from .prepared import PreparedObjects
from .run_state import RunState
from .run_views import RunViews

__all__ = ["RunFiles"]


class RunFiles(RunViews):
    """The Accelerator's methods that save and restore models, objects and checkpoints."""

    accumulator: GradientAccumulator
    scaler: Any
    _prepared: PreparedObjects
    _background_saves: BackgroundSaver

    # --- models ------------------------------------------------------------------------------

    def unwrap_model(
        self, model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> Any:
        """The user's model from inside DDP / compile / precision wrappers."""
        return self.engine.unwrap_model(
            model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile
        )

    def get_state_dict(self, model: Any, unwrap: bool = True) -> dict[str, Any]:
        """The model's state dict (of the unwrapped model by default).

        A model with offloaded weights (CPU or disk offload hooks) gets its real weights,
        brought in one module at a time, on the CPU. Under FSDP2 this is a collective (call it
        on every process): the main process gets the full weights on the CPU, the others
        ``{}``.
        """
        if unwrap:
            model = self.unwrap_model(model)
        return self.engine.model_state_dict(model)

    def verify_device_map(self, model: torch.nn.Module) -> bool:
        """Whether ``model`` (or a submodule) was dispatched over several devices."""
        return any(has_multi_device_map(module) for module in model.modules())

    def save(self, obj: Any, f: str | os.PathLike[str], safe_serialization: bool = False) -> None:
        """Save ``obj`` from the main process, atomically (a crash leaves no partial file)."""
        _save(
            obj,
            f,
            save_on_each_node=self.project_configuration.save_on_each_node,
            safe_serialization=safe_serialization,
        )

    # --- checkpoints -----------------------------------------------------------------------------

    def save_state(
        self,
        output_dir: str | os.PathLike[str] | None = None,
        safe_serialization: bool = True,
        async_save: bool | None = None,
        **save_model_func_kwargs: Any,
    ) -> str:
        """Save everything needed to resume the run exactly; return the checkpoint directory.

        Writes Accelerate's layout (``model.safetensors``, ``optimizer.bin``,
        ``scheduler.bin``, ``dl_state_dict.bin``, ``scaler.pt``, ``random_states_<rank>.pkl``,
        ``custom_checkpoint_<i>.pkl``) plus a manifest, into a hidden sibling that is renamed
        into place only when complete. With ``automatic_checkpoint_naming`` the directory is
        ``<project_dir>/checkpoints/checkpoint_<n>`` and, once it is complete, the oldest
        checkpoints beyond ``total_limit`` are deleted.

        With ``async_save=True`` (``None``: ``ProjectConfiguration.async_save``) the call
        returns once the state is copied into host memory (buffers kept between saves: one
        checkpoint's worth), and a background thread writes the same files with the same
        crash-safe protocol. One save is in flight at most: the next ``save_state``,
        ``load_state``, ``resume``, ``end_training`` and interpreter exit wait for it, as does
        :meth:`wait_for_checkpoint`; a failed write is raised by the next of those calls or by
        ``backward``. Under FSDP2 the shards (or the gathered full state) are captured and
        DCP writes them on the writer threads; DeepSpeed and tensor parallelism alone refuse
        it before anything is written.

        Raises:
            ValueError: no ``output_dir`` without automatic naming; the automatic directory
                already exists; ``output_dir`` is a file; ``async_save`` under DeepSpeed or
                tensor parallelism alone.
            TypeError: ``async_save`` is not a bool or None.
        """
        if save_model_func_kwargs:
            raise TypeError(
                f"save_state() got unexpected arguments {sorted(save_model_func_kwargs)}"
            )
        if async_save is None:
            async_save = self.project_configuration.async_save
        if not isinstance(async_save, bool):
            raise TypeError(
                f"save_state(async_save={async_save!r}): pass True, False or None (None: "
                "ProjectConfiguration.async_save)"
            )
        saves = self._background_saves
        saves.wait()
        return checkpoint_writing.save_state(
            self._run_state(),
            output_dir,
            safe_serialization,
            background=saves if async_save else None,
        )

    def wait_for_checkpoint(self) -> None:
        """Wait until the checkpoint being written in the background is complete.

        Returns at once when no asynchronous save is in flight.

        Raises:
            OSError, CheckpointError, ...: the background write failed (on this process, or
                on another one: then a ``CheckpointError``); the checkpoint was not committed
                and the previous ones are untouched.
        """
        self._background_saves.wait()

    def load_state(
        self,
        input_dir: str | os.PathLike[str] | None = None,
        load_kwargs: dict[str, Any] | None = None,
        **load_model_func_kwargs: Any,
    ) -> str:
        """Restore a checkpoint written by :meth:`save_state` (or by Accelerate).

        Everything is checked before anything changes; a missing, truncated or mismatched
        file raises ``CheckpointError`` naming it and leaves the run untouched. Without
        ``input_dir``, automatic naming loads the newest complete checkpoint.
        ``load_kwargs={"map_location": ...}`` chooses where tensors are loaded ("cpu", the
        default on one device or CPU processes; "on_device" on several accelerators).

        Returns:
            The directory that was loaded.
        """
        options = dict(load_kwargs or {})
        options.update(load_model_func_kwargs)
        self._background_saves.wait()
        unknown = sorted(set(options) - {"map_location"})
        if unknown:
            raise TypeError(
                f"load_state() got unsupported options {unknown}: only map_location "
                "('cpu', 'on_device' or a device) is accepted"
            )
        return checkpointing.load_state(self._run_state(), input_dir, **options)

    def resume(self) -> Resumed:
        """Continue from the project's newest complete checkpoint, if there is one.

        Call it once, after ``prepare`` and before the training loop. With
        ``ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True)`` it loads
        the newest ``checkpoint_<n>`` that verifies (as :meth:`load_state` does: weights,
        optimizers, schedulers, loader positions, random states, accumulation state), so that
        the same command starts a run, continues it after ``accel launch --max_restarts``
        restarts it, after a SLURM requeue or after a manual rerun. A newer checkpoint whose
        files do not match its manifest is skipped with a warning. On a fresh start nothing
        changes.

        Returns:
            A :class:`~accel.auto_resume.Resumed` (true when a checkpoint was loaded) with the
            checkpoint, ``epoch`` (the epoch the first prepared loader continues, mid-epoch)
            and ``batches_seen`` (its batches already trained on, all epochs together)::

                resumed = accelerator.resume()
                seen = resumed.batches_seen
                for epoch in range(resumed.epoch, num_epochs):
                    for batch in loader:  # resumes where the checkpoint was taken
                        ...
                        seen += 1
                        if seen % 500 == 0:
                            accelerator.save_state()

        Raises:
            ValueError: automatic checkpoint naming is off or there is no project directory,
                or nothing was prepared yet.
            CheckpointError: the chosen checkpoint cannot be loaded (see :meth:`load_state`).
        """
        self._background_saves.wait()
        prepared = self._prepared
        if not (prepared.models or prepared.optimizers or prepared.dataloaders):
            raise ValueError(
                "resume() loads the checkpoint into the prepared objects: call it after "
                "accelerator.prepare(...)"
            )
        run = self._run_state()
        directory, skipped = choose_checkpoint(run)
        log_skipped(skipped)
        if directory is None:
            return Resumed(None, skipped=tuple(skipped))
        loaded = checkpointing.load_state(run, directory)
        skip_numbers_in_use(run)
        epoch, seen = loader_position(list(prepared.dataloaders))
        return Resumed(
            loaded,
            epoch=epoch,
            batches_seen=seen,
            step=self.gradient_state.step,
            skipped=tuple(skipped),
        )

    def _run_state(self) -> RunState:
        prepared = self._prepared
        return RunState(
            models=prepared.models,
            optimizers=prepared.optimizers,
            schedulers=prepared.schedulers,
            dataloaders=prepared.dataloaders,
            custom_objects=prepared.custom_objects,
            scaler=self.scaler,
            gradient_state=self.gradient_state,
            accumulator=self.accumulator,
            project_configuration=self.project_configuration,
            engine=self.engine,
            save_pre_hooks=list(prepared.save_pre_hooks.values()),
            load_pre_hooks=list(prepared.load_pre_hooks.values()),
            device=self.device,
        )

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore ``objects`` (each with ``state_dict``/``load_state_dict``) too.

        Raises:
            ValueError: some objects lack the two methods; the message lists their indices.
        """
        self._prepared.register_for_checkpointing(objects)

    def register_save_state_pre_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """Call ``hook(models, weights, output_dir)`` before each :meth:`save_state`.

        The hook may edit ``weights`` (setting an entry to ``None`` skips that model) and write
        extra files into ``output_dir`` (the directory being assembled).
        """
        return _add_hook(self._prepared.save_pre_hooks, hook)

    def register_load_state_pre_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """Call ``hook(models, input_dir)`` before each :meth:`load_state`."""
        return _add_hook(self._prepared.load_pre_hooks, hook)

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str | os.PathLike[str],
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Save the unwrapped model's weights for inference, sharded above ``max_shard_size``.

        Writes ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` with
        ``model.safetensors.index.json``; ``pytorch_model*.bin`` without safetensors) on the
        main process; stale shards of an earlier save are removed. Under FSDP2 every process
        takes part and the main process gathers one shard file's tensors at a time.
        """
        self.engine.save_model(
            model,
            os.fspath(save_directory),
            max_shard_size=max_shard_size,
            safe_serialization=safe_serialization,
        )
        self.wait_for_everyone()


def _add_hook(hooks: OrderedDict[int, Callable[..., Any]], hook: Callable[..., Any]) -> Any:
    """Add ``hook`` to ``hooks``; return the handle that removes it."""
    handle = RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle
