"""Loading checkpoints into models, streamed tensor by tensor under a memory bound.

:func:`load_checkpoint_in_model` takes a single checkpoint file, a sharded checkpoint's
``*.index.json``, or a folder holding either, and puts every tensor where a device map says,
with Accelerate's semantics. Unlike Accelerate it never materialises a whole shard: for each
tensor it allocates the destination and reads the bytes straight into it (through
:class:`~accel_bigmodel.safetensors_files.SafetensorsFile`), so peak memory is the model's
resident part plus one tensor. Disk-mapped weights of a safetensors checkpoint are not copied
anywhere: they are recorded in the model's offload registry (see
:func:`~accel_bigmodel.offload.register_offload_index`) and read in place later. Everything that
can be checked before the model changes (keys under ``strict``, shapes, devices, whether an
offload folder is needed) is checked first, so a bad checkpoint leaves the model as it was.

Pickled checkpoints (``.bin``/``.pt``) are only ever read with ``torch.load(weights_only=True)``.
A progress bar over the tensors is shown on a terminal (:func:`accel_state.progress.progress_bar`).

The work is split along the load's stages: :mod:`.files` resolves a checkpoint to its files
and reads single files, :mod:`.plan` reads the layouts, validates them against the model and
decides each tensor's step, :mod:`.stream` carries the steps out (through :mod:`.source`, which
reads one file), and :mod:`.dcp` is the distributed path for DTensor models.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from accel_bigmodel.device_plan import DevicePlan
from accel_bigmodel.tensors import (
    DeviceLike,
    check_tied_parameters_in_config,
    check_tied_parameters_on_same_device,
    find_tied_parameters,
    parse_dtype,
    retie_parameters,
)
from accel_state.environment import ACCEL_DISABLE_PROGRESS_BAR

from .dcp import has_dtensor, load_with_dcp
from .files import checkpoint_files, load_state_dict
from .plan import LoadOptions, Planner, Step, read_layouts, validate
from .stream import stream

__all__ = ["DISABLE_PROGRESS_BAR_ENV", "load_checkpoint_in_model", "load_state_dict"]

logger = logging.getLogger(__name__)

DISABLE_PROGRESS_BAR_ENV = ACCEL_DISABLE_PROGRESS_BAR
"""Set this environment variable to a true value to hide the shard progress bar."""


def load_checkpoint_in_model(  # noqa: PLR0913 - Accelerate's signature
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    device_map: Mapping[str, DeviceLike] | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    keep_in_fp32_modules: Sequence[str] | None = None,
    offload_8bit_bnb: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> None:
    """Load a (possibly sharded) checkpoint into ``model``, one tensor at a time.

    Without ``device_map`` the checkpoint is copied into the model's tensors where they are
    (tensors on the meta device are materialised on the CPU in the checkpoint's dtype). With
    ``device_map`` each tensor goes to the device of its longest matching module prefix, cast
    to ``dtype`` when given (floating-point tensors only; ``keep_in_fp32_modules`` stay in
    float32 when ``dtype`` is float16). ``"disk"`` tensors become meta: for a safetensors
    checkpoint without a dtype change they are read in place later (recorded with
    :func:`~accel_bigmodel.offload.register_offload_index`, nothing is written); otherwise they
    are written to ``offload_folder`` in Accelerate's format. Tied parameters are re-tied at the
    end. Call ``dispatch_model`` afterwards to run a model spread over several devices.

    Args:
        model: the model (typically built under ``init_empty_weights``).
        checkpoint: a checkpoint file, a sharded checkpoint's ``*.index.json``, or a folder with
            ``pytorch_model.bin``, ``model.safetensors`` or exactly one ``*.index.json``.
        device_map: ``{module name: device}`` (``int``, ``"cpu"``, ``"cuda:1"``, ``"disk"`` ...).
        offload_folder: where disk-mapped weights are written when they must be (``.bin``
            checkpoints, or a dtype change); not needed for safetensors checkpoints otherwise.
        dtype: cast floating-point weights to this dtype.
        offload_state_dict: keep CPU-mapped weights out of RAM until all shards are read
            (staged on disk for ``.bin`` or converted weights, read last for safetensors).
        offload_buffers: also treat buffers of disk-mapped modules as disk weights (by default
            they are loaded on the CPU).
        keep_in_fp32_modules: module names kept in float32 when ``dtype`` is float16.
        offload_8bit_bnb: bitsandbytes 8-bit offload; not supported (must be ``False``).
        strict: raise when checkpoint and model keys differ (checked before loading).
        full_state_dict: with DTensor (FSDP2) models, the checkpoint holds full tensors.
        broadcast_from_rank0: rank 0 reads the checkpoint and broadcasts it (needs a process
            group; no ``device_map``).

    Raises:
        NotImplementedError: ``offload_8bit_bnb=True``.
        TypeError: ``device_map`` is not a mapping from module names to devices.
        ValueError: a bad checkpoint path or index, a damaged checkpoint file (named), a device
            map that does not place some tensor, holds a non-device, names a device this
            machine lacks or places a module twice, a shape mismatch (naming the
            tensor and both shapes), disk weights that must be written without
            ``offload_folder``, an ``offload_folder`` that is a file, or a bad ``dtype``.
        RuntimeError: ``strict=True`` and keys are missing or unexpected.
        pickle.UnpicklingError: a ``.bin`` file holds objects other than tensors.
    """
    if offload_8bit_bnb:
        raise NotImplementedError(
            "offload_8bit_bnb=True: accel-bigmodel does not quantise or offload bitsandbytes "
            "8-bit weights. Pass offload_8bit_bnb=False, or load the model with transformers' "
            "BitsAndBytesConfig."
        )
    wanted = parse_dtype(dtype)  # checked before device_map, as it always was
    # The one parse of device_map on this path: the loader gets the plan.
    plan = None if device_map is None else DevicePlan.from_device_map(device_map, model)
    load_checkpoint(
        model,
        checkpoint,
        LoadOptions(
            plan=plan,
            offload_folder=offload_folder,
            dtype=wanted,
            offload_state_dict=offload_state_dict,
            offload_buffers=offload_buffers,
            keep_in_fp32_modules=keep_in_fp32_modules,
            strict=strict,
            full_state_dict=full_state_dict,
            broadcast_from_rank0=broadcast_from_rank0,
        ),
    )


def load_checkpoint(
    model: nn.Module, checkpoint: str | os.PathLike[str], options: LoadOptions
) -> None:
    """:func:`load_checkpoint_in_model` with its arguments in ``options``.

    ``options.plan`` is the ``device_map`` the entry point parsed (it is not parsed again
    here). ``options`` may also carry ``rename`` (checkpoint keys to the model's names; needs a
    plan) and ``refuse_missing`` (raise
    :class:`~accel_bigmodel.loading.plan.MissingWeightsError` before the model changes when a
    meta tensor of the model would be left without a value).
    """
    dtype = parse_dtype(options.dtype)
    plan = options.plan
    folder = options.offload_folder
    if folder is not None and os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(
            f"offload_folder={os.fspath(folder)!r} is a file, not a folder: pass the path of a "
            "folder (it is created when weights must be written there)."
        )
    if options.broadcast_from_rank0 and plan is not None:
        raise ValueError(
            "broadcast_from_rank0=True works without a device_map only (rank 0 reads and "
            "broadcasts a full state dict): pass device_map=None or broadcast_from_rank0=False."
        )
    tied = _tied_groups(model, plan)
    checkpoint_path = os.fspath(checkpoint)
    files = checkpoint_files(checkpoint_path)
    if plan is None and (options.broadcast_from_rank0 or has_dtensor(model)):
        if options.rename is not None:
            raise ValueError("renaming checkpoint keys needs a device_map")
        unexpected = load_with_dcp(
            model,
            files,
            strict=options.strict,
            full_state_dict=options.full_state_dict,
            broadcast_from_rank0=options.broadcast_from_rank0,
        )
        _warn_unexpected(unexpected, checkpoint_path, model, options.strict)
        return

    layout = read_layouts(files, options.rename)
    if layout.no_metadata:
        logger.warning(
            "The safetensors checkpoint %s has no metadata; assuming it holds PyTorch ('pt') "
            "tensors. Save with metadata={'format': 'pt'} to silence this.",
            checkpoint_path,
        )
    model_tensors = model.state_dict(keep_vars=True)
    unexpected, missing = validate(model, layout, model_tensors, tied, options)
    buffer_names = frozenset(name for name, _ in model.named_buffers())
    steps = Planner(plan, dtype, options, buffer_names).plan(layout, model_tensors)
    del model_tensors
    _prepare_offload_folder(steps, plan, options.offload_folder)

    stream(model, layout, steps, options.offload_folder, tied)

    _warn_unexpected(unexpected, checkpoint_path, model, options.strict)
    if missing:
        logger.warning(
            "Some weights of %s were not in the checkpoint %s and keep their current values: %s",
            type(model).__name__,
            checkpoint_path,
            sorted(missing),
        )
    retie_parameters(model, tied)


def _tied_groups(model: nn.Module, plan: DevicePlan | None) -> list[list[str]]:
    """The model's tied parameters, checked to be tied and to share a device."""
    tied = find_tied_parameters(model)
    if check_tied_parameters_in_config(model) and not tied:
        logger.warning(
            "The model's configuration says some weights are tied but none are: call "
            "model.tie_weights() before loading."
        )
    if plan is not None:
        check_tied_parameters_on_same_device(tied, plan.placements)
    return tied


def _prepare_offload_folder(
    steps: Mapping[str, Step],
    plan: DevicePlan | None,
    offload_folder: str | os.PathLike[str] | None,
) -> None:
    """Refuse disk weights that must be written without a folder; create the folder if used."""
    if offload_folder is None and any(s.action == "disk_write" for s in steps.values()):
        written = sorted(s.name for s in steps.values() if s.action == "disk_write")
        raise ValueError(
            "offload_folder=None, but device_map sends weights to 'disk' that must be written "
            f"to an offload folder ({written[:5]}{' ...' if len(written) > 5 else ''}: the "
            "checkpoint is not safetensors or dtype= converts them). Pass "
            "offload_folder='path/to/folder'. The model was not changed."
        )
    if offload_folder is not None and plan is not None and plan.has_disk:
        os.makedirs(offload_folder, exist_ok=True)


def _warn_unexpected(unexpected: set[str], checkpoint: str, model: nn.Module, strict: bool) -> None:
    if unexpected and not strict:
        logger.warning(
            "Some weights of the checkpoint at %s were not used when initialising %s: %s. This "
            "may or may not be an issue: check that the checkpoint belongs to this model.",
            checkpoint,
            type(model).__name__,
            sorted(unexpected),
        )
