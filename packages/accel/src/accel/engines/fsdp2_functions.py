"""Accelerate's FSDP checkpoint functions: one model or optimizer at a time, in its layout.

``save_fsdp_model`` / ``load_fsdp_model`` / ``save_fsdp_optimizer`` / ``load_fsdp_optimizer``
are what transformers' ``Trainer`` calls to checkpoint an FSDP run (``save_state`` does the same
for every prepared object at once). They write and read the files ``save_state`` writes
(:mod:`.fsdp2_checkpoint`: ``pytorch_model_fsdp_<i>/`` and ``optimizer_<i>/`` DCP folders for
``SHARDED_STATE_DICT``, ``pytorch_model_fsdp[_<i>].bin`` and ``optimizer[_<i>].bin`` on rank 0 for
``FULL_STATE_DICT``), so a checkpoint moves between the two APIs and between accel and
Accelerate. Every function is a collective (every rank calls it). ``adapter_only`` saves and
loads only the trainable parameters of a peft model, as Accelerate's ``Trainer`` path asks.
``get_parameters_from_modules`` (trl imports it) turns FSDP's ignored modules into parameters.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .fsdp2_checkpoint import (
    read_model_state,
    read_optimizer_state,
    save_model_state,
    save_optimizer_state,
    torch_optimizer,
)

__all__ = [
    "get_parameters_from_modules",
    "load_fsdp_model",
    "load_fsdp_optimizer",
    "save_fsdp_model",
    "save_fsdp_optimizer",
]


def _full(fsdp_plugin: Any) -> bool:
    """Whether the plugin asks for full files (else sharded DCP folders)."""
    name = getattr(fsdp_plugin.state_dict_type, "name", fsdp_plugin.state_dict_type)
    if str(name) == "LOCAL_STATE_DICT":
        raise ValueError(
            "fsdp_plugin.state_dict_type='LOCAL_STATE_DICT' is FSDP1's, and accel trains FSDP2: "
            "use SHARDED_STATE_DICT (the default) or FULL_STATE_DICT"
        )
    return str(name) == "FULL_STATE_DICT"


def _require_group(function: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{function}() needs the FSDP2 run's process group: call it after "
            "Accelerator(fsdp_plugin=...).prepare(model, ...), on every process"
        )


def _refuse_per_rank_files(use_dcp: bool, function: str) -> None:
    if not use_dcp:
        raise NotImplementedError(
            f"{function}(use_dcp=False) writes Accelerate's per-rank torch.save files, which "
            "accel does not build; leave use_dcp=True (torch.distributed.checkpoint, which also "
            "reshards when the number of processes changes)"
        )


def _adapter_state(model: Any, full: bool) -> dict[str, Any]:
    """The trainable parameters of a peft model, as ``save_fsdp_model(adapter_only=True)``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=full, cpu_offload=full, ignore_frozen_params=True)
    return get_model_state_dict(model, options=options)


def _is_peft(model: Any) -> bool:
    from accel.models import is_peft_model

    return is_peft_model(model)


def save_fsdp_model(
    fsdp_plugin: Any,
    accelerator: Any,
    model: Any,
    output_dir: str | os.PathLike[str],
    model_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
) -> None:
    """Save a prepared FSDP2 model as ``save_state`` does (every rank calls it).

    Args:
        fsdp_plugin: The run's ``FullyShardedDataParallelPlugin`` (its ``state_dict_type``
            chooses full files or sharded folders).
        accelerator: The ``Accelerator`` (kept for Accelerate's signature).
        model: The prepared model.
        output_dir: The folder to write into (created).
        model_index: Which model of the run (``pytorch_model_fsdp_<model_index>``).
        adapter_only: For a peft model, save only its trainable (adapter) parameters.
        use_dcp: Must be True (Accelerate's per-rank files are not built).

    Raises:
        RuntimeError: no process group (the model was not prepared with FSDP2).
        ValueError: a ``LOCAL_STATE_DICT`` plugin.
        NotImplementedError: ``use_dcp=False``.
    """
    _refuse_per_rank_files(use_dcp, "save_fsdp_model")
    full = _full(fsdp_plugin)
    _require_group("save_fsdp_model")
    directory = Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    state = _adapter_state(model, full) if adapter_only and _is_peft(model) else None
    save_model_state(model, model_index, directory, full=full, state=state)


def load_fsdp_model(
    fsdp_plugin: Any,
    accelerator: Any,
    model: Any,
    input_dir: str | os.PathLike[str],
    model_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
) -> None:
    """Load what :func:`save_fsdp_model` (or ``save_state``) wrote into a prepared FSDP2 model.

    Everything is read and checked (names, shapes) before the model changes.

    Raises:
        CheckpointError: the folder lacks the model's files or they do not fit the model (on
            every rank; nothing changed).
        RuntimeError, ValueError, NotImplementedError: as :func:`save_fsdp_model`.
    """
    _refuse_per_rank_files(use_dcp, "load_fsdp_model")
    full = _full(fsdp_plugin)
    _require_group("load_fsdp_model")
    adapter = adapter_only and _is_peft(model)
    read_model_state(model, model_index, Path(input_dir), full=full, adapter=adapter)()


def save_fsdp_optimizer(
    fsdp_plugin: Any,
    accelerator: Any,
    optimizer: Any,
    model: Any,
    output_dir: str | os.PathLike[str],
    optimizer_index: int = 0,
) -> None:
    """Save the optimizer of a prepared FSDP2 model as ``save_state`` does (every rank).

    Raises:
        RuntimeError, ValueError: as :func:`save_fsdp_model`.
    """
    full = _full(fsdp_plugin)
    _require_group("save_fsdp_optimizer")
    directory = Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    save_optimizer_state(torch_optimizer(optimizer), model, optimizer_index, directory, full=full)


def load_fsdp_optimizer(
    fsdp_plugin: Any,
    accelerator: Any,
    optimizer: Any,
    model: Any,
    input_dir: str | os.PathLike[str],
    optimizer_index: int = 0,
    adapter_only: bool = False,
) -> None:
    """Load what :func:`save_fsdp_optimizer` wrote (checked before the optimizer changes).

    ``adapter_only`` is accepted for Accelerate's signature: the optimizer of a peft model holds
    only its trainable parameters either way.

    Raises:
        CheckpointError: the optimizer's files are missing or unreadable (on every rank).
        RuntimeError, ValueError: as :func:`save_fsdp_model`.
    """
    full = _full(fsdp_plugin)
    _require_group("load_fsdp_optimizer")
    inner = torch_optimizer(optimizer)
    read_optimizer_state(inner, model, optimizer_index, Path(input_dir), full=full)()


def get_parameters_from_modules(
    modules: Iterable[torch.nn.Module] | str | None, model: torch.nn.Module, device: Any
) -> set[torch.nn.Parameter]:
    """The parameters of ``modules``: modules, or a regular expression over ``model``'s names.

    A pattern selects the modules whose full dotted name matches it entirely, and moves them to
    ``device`` (Accelerate's behaviour; FSDP leaves these modules unsharded). ``None``: no
    parameters.

    Raises:
        re.error: ``modules`` is a string that is not a regular expression.
    """
    if modules is None:
        return set()
    if isinstance(modules, str):
        pattern = re.compile(modules)
        chosen = [module for name, module in model.named_modules() if pattern.fullmatch(name)]
        for module in chosen:
            module.to(device)
        modules = chosen
    return {parameter for module in modules for parameter in module.parameters()}
