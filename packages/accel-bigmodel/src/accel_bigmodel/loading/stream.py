"""Carrying out a load plan: file by file, each tensor read straight into its destination.

:func:`stream` opens each checkpoint file once, walks its tensors in file order and hands each
:class:`~accel_bigmodel.loading.plan.Step` to a :class:`_Streamer`, which has one method per
action and collects what the steps did (the tensors placed, the offload indexes). Tensors that
``offload_state_dict`` postpones are read last; disk-mapped safetensors weights end up in the
model's offload registry, written ones in the offload folder's ``index.json``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from accel_bigmodel.offload import (
    OffloadIndex,
    forget_offloaded,
    load_offloaded_weights,
    offload_weight,
    register_offload_index,
    save_offload_index,
)
from accel_bigmodel.tensors import module_tensor, set_module_tensor_to_device
from accel_state.progress import progress_bar

from .plan import Action, CheckpointLayout, Step
from .source import Source, Staging


def stream(
    model: nn.Module,
    layout: CheckpointLayout,
    steps: Mapping[str, Step],
    offload_folder: str | os.PathLike[str] | None,
    tied: Sequence[Sequence[str]],
) -> None:
    """Carry out ``steps`` file by file, each tensor read straight into its destination."""
    streamer = _Streamer(model, offload_folder)
    per_file: dict[int, list[str]] = {}
    for name, position in layout.owner.items():
        if name in steps:
            per_file.setdefault(position, []).append(name)
    try:
        with progress_bar(len(steps), "Loading checkpoint weights", "tensor") as bar:
            for position, path in enumerate(layout.files):
                names = per_file.get(position, [])
                if not names:
                    continue
                source = Source(path, streamer.staging, layout.renamed[position])
                try:
                    for name in source.order(names):
                        streamer.apply(source, steps[name])
                        bar.update(1)
                finally:
                    source.close()
        streamer.finish_deferred(layout)
    finally:
        streamer.remove_stage_folder()
    streamer.record(steps, tied)


class _Streamer:
    """Carries out the steps of one load, one method per :data:`~.plan.Action`.

    Its fields collect what the steps did: the names now holding their values (``placed``),
    the weights written to the offload folder (``offload_index``) or served in place from
    safetensors files (``registry``), and the CPU weights ``offload_state_dict`` postpones
    (``deferred``, read from their safetensors file at the end; ``stage_index``, written to a
    temporary ``stage_folder`` and read back at the end).
    """

    def __init__(self, model: nn.Module, offload_folder: str | os.PathLike[str] | None) -> None:
        self.model = model
        self.offload_folder = offload_folder
        self.staging = Staging()
        self.placed: list[str] = []
        self.offload_index: OffloadIndex = {}
        self.registry: OffloadIndex = {}
        self.deferred: list[Step] = []
        self.stage_folder: str | None = None
        self.stage_index: OffloadIndex = {}
        self._actions: dict[Action, Callable[[Source, Step], None]] = {
            "inplace": self._inplace,
            "device": self._device,
            "disk_inplace": self._disk_inplace,
            "disk_write": self._disk_write,
            "stage_defer": self._stage_defer,
            "stage_write": self._stage_write,
        }

    def apply(self, source: Source, step: Step) -> None:
        """Carry out ``step``, reading its tensor from ``source``."""
        self._actions[step.action](source, step)

    def _inplace(self, source: Source, step: Step) -> None:
        with torch.no_grad():
            source.into(step.name, module_tensor(self.model, step.name).detach())
        self.placed.append(step.name)

    def _device(self, source: Source, step: Step) -> None:
        assert step.device is not None
        self._place(step, source.value(step.name, step.device, step.dtype))

    def _disk_inplace(self, source: Source, step: Step) -> None:
        self.registry[step.name] = source.offload_entry(step.name)
        self._to_meta(step)

    def _disk_write(self, source: Source, step: Step) -> None:
        assert self.offload_folder is not None
        self._write(source, step, self.offload_folder, self.offload_index)

    def _stage_defer(self, source: Source, step: Step) -> None:
        self._to_meta(step)
        self.deferred.append(step)

    def _stage_write(self, source: Source, step: Step) -> None:
        if self.stage_folder is None:
            self.stage_folder = tempfile.mkdtemp(prefix="accel-stage-")
        self._write(source, step, self.stage_folder, self.stage_index)

    def _place(self, step: Step, value: torch.Tensor) -> None:
        assert step.device is not None
        set_module_tensor_to_device(
            self.model, step.name, step.device, value=value, dtype=step.dtype
        )
        self.placed.append(step.name)

    def _write(
        self, source: Source, step: Step, folder: str | os.PathLike[str], index: OffloadIndex
    ) -> None:
        value = source.value(step.name, torch.device("cpu"), step.dtype)
        offload_weight(value, step.name, folder, index=index)
        del value
        self._to_meta(step)

    def _to_meta(self, step: Step) -> None:
        set_module_tensor_to_device(self.model, step.name, "meta", dtype=step.dtype)

    def finish_deferred(self, layout: CheckpointLayout) -> None:
        """Read the CPU weights whose loading ``offload_state_dict`` postponed to the end."""
        by_file: dict[int, list[Step]] = {}
        for step in self.deferred:
            by_file.setdefault(layout.owner[step.name], []).append(step)
        for position, file_steps in sorted(by_file.items()):
            source = Source(layout.files[position], self.staging, layout.renamed[position])
            try:
                for step in file_steps:
                    assert step.device is not None
                    self._place(step, source.value(step.name, step.device, step.dtype))
            finally:
                source.close()
        if self.stage_folder is not None:
            load_offloaded_weights(self.model, self.stage_index, self.stage_folder)
            self.placed.extend(self.stage_index)

    def remove_stage_folder(self) -> None:
        """Delete the temporary folder of staged weights, if one was made."""
        if self.stage_folder is not None:
            shutil.rmtree(self.stage_folder, ignore_errors=True)

    def record(self, steps: Mapping[str, Step], tied: Sequence[Sequence[str]]) -> None:
        """Write the offload folder's index and update the model's offload registry."""
        if self.offload_index:
            assert self.offload_folder is not None
            save_offload_index(self.offload_index, self.offload_folder)
        resident = set(self.placed) | set(self.offload_index)
        # A tied name absent from the checkpoint follows its partner (it may have had an alias).
        resident.update(name for group in tied if resident.intersection(group) for name in group)
        forget_offloaded(self.model, sorted(resident))
        if self.registry:
            _alias_tied_entries(self.registry, steps, tied)
            register_offload_index(self.model, self.registry)


def _alias_tied_entries(
    registry: OffloadIndex, steps: Mapping[str, Step], tied: Sequence[Sequence[str]]
) -> None:
    """Give tied names absent from the checkpoint the in-place entry of their loaded partner."""
    for group in tied:
        source = next((registry[name] for name in group if name in registry), None)
        if source is None:
            continue
        for name in group:
            if name not in registry and name not in steps:
                registry[name] = dict(source)
