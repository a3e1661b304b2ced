"""How FSDP2 models and optimizers are stored in a checkpoint: Accelerate 1.15's layout.

``SHARDED_STATE_DICT`` (the default): every rank writes its shards with
``torch.distributed.checkpoint`` (DCP) into ``pytorch_model_fsdp_<i>/`` (key ``"model"``) and
``optimizer_<i>/`` (key ``"optimizer"``); DCP reshards on load, so a checkpoint loads at
another world size. ``FULL_STATE_DICT``: rank 0 writes ``pytorch_model_fsdp.bin``
(``pytorch_model_fsdp_<i>.bin``) and ``optimizer.bin`` (``optimizer_<i>.bin``), and on load
rank 0 reads them and broadcasts. These are the names Accelerate writes and reads, so
checkpoints move both ways.

Loading reads and checks everything (names and shapes against the prepared model) into
staged copies before anything is applied, as the rest of ``load_state`` does. Each optimizer
is paired with the models that hold its parameters, not by position (Accelerate pairs by
index, and a failed ``prepare`` then mis-pairs them).

Pending gradients (a checkpoint inside an accumulation window): FSDP2 keeps the gradients of
the open window unsharded and unreduced inside each FSDP parameter; they are saved per rank and
put back in the same place, so the window completes bit for bit after a resume.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from accel_state.serialization import load as _safe_load
from accel_state.torch_support import torch_has

from .base import CheckpointLayout, LayoutCapture

__all__ = [
    "FSDP2Layout",
    "LayoutEngine",
    "MODEL_FOLDER",
    "OPTIMIZER_FOLDER",
    "RunDevice",
    "TensorParallelLayout",
    "read_model_state",
    "read_optimizer_state",
    "save_model_state",
    "save_optimizer_state",
    "torch_optimizer",
]

MODEL_FOLDER = "pytorch_model_fsdp"
OPTIMIZER_FOLDER = "optimizer"


def _indexed(name: str, index: int, ext: str) -> str:
    return f"{name}{ext}" if index == 0 else f"{name}_{index}{ext}"


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accel-amp's ``AcceleratedOptimizer``."""
    from accel_amp import AcceleratedOptimizer

    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _checkpoint_error(message: str) -> Exception:
    from accel.checkpointing import CheckpointError

    return CheckpointError(message)


def _models_of(optimizer: torch.optim.Optimizer, models: Sequence[Any]) -> Any:
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    owners = [m for m in models if any(id(p) in ids for p in m.parameters())]
    if not owners:
        raise _checkpoint_error(
            "save_state/load_state: a prepared optimizer holds parameters of no prepared FSDP2 "
            "model; prepare the model and its optimizer with the same Accelerator"
        )
    return owners[0] if len(owners) == 1 else tuple(owners)


def _agree(problem: str | None) -> None:
    """Raise the same CheckpointError on every rank when any rank found a problem."""
    found: list[Any] = [problem]
    if dist.is_initialized() and dist.get_world_size() > 1:
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, problem)
    for entry in found:
        if entry is not None:
            raise _checkpoint_error(entry)


class RunDevice(Protocol):
    """The part of the run's state a layout reads: the device this process computes on."""

    @property
    def device(self) -> torch.device:
        """This process's device."""
        ...


class LayoutEngine(Protocol):
    """What :class:`FSDP2Layout` needs from the engine that builds it (FSDP2, tensor parallel).

    Declared here so that the engines depend on their layout and not the reverse: any object
    whose ``state.device`` is the run's device will do.
    """

    @property
    def state(self) -> RunDevice:
        """The run's state; pending gradients are put back on its ``device``."""
        ...


class FSDP2Layout(CheckpointLayout):
    """Save and load FSDP2 models and optimizers (see the module docstring).

    Args:
        engine: The engine building the layout (see :class:`LayoutEngine`).
        full: ``FULL_STATE_DICT`` (rank 0 writes whole files) instead of DCP shards.
    """

    writes_in_background = True

    def __init__(self, engine: LayoutEngine, *, full: bool) -> None:
        self.engine = engine
        self.full = full

    # --- saving --------------------------------------------------------------------------

    def save(self, models: Sequence[Any], optimizers: Sequence[Any], directory: Path) -> None:
        """Write every model and optimizer (a collective)."""
        for index, model in enumerate(models):
            save_model_state(model, index, directory, full=self.full)
        for index, optimizer in enumerate(optimizers):
            inner = torch_optimizer(optimizer)
            save_optimizer_state(inner, _models_of(inner, models), index, directory, full=self.full)

    def capture(self, models: Sequence[Any], optimizers: Sequence[Any]) -> LayoutCapture:
        """The state dicts :meth:`save` writes, and the writer-thread function writing them.

        Sharded: each rank's DTensor shards (DCP's collectives then run on the writer
        threads' own group); full: the weights gathered on rank 0 now (a collective).
        """
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        full = self.full
        states: dict[str, Any] = {}
        for index, model in enumerate(models):
            states[f"model_{index}"] = get_model_state_dict(model, options=_options(full))
        for index, optimizer in enumerate(optimizers):
            inner = torch_optimizer(optimizer)
            owner = _models_of(inner, models)
            states[f"optimizer_{index}"] = get_optimizer_state_dict(
                owner, inner, options=_options(full)
            )
        counts = (len(models), len(optimizers))

        def write(directory: Path, copies: dict[str, Any], group: Any) -> None:
            for index in range(counts[0]):
                state = copies[f"model_{index}"]
                _write(state, directory, MODEL_FOLDER, "model", index, full=full, group=group)
            for index in range(counts[1]):
                state = copies[f"optimizer_{index}"]
                _write(
                    state, directory, OPTIMIZER_FOLDER, "optimizer", index, full=full, group=group
                )

        return LayoutCapture(states, write)

    # --- loading -------------------------------------------------------------------------

    def prepare_load(
        self, models: Sequence[Any], optimizers: Sequence[Any], directory: Path
    ) -> Callable[[], None]:
        """Read and check every state into staged copies; return the function applying them."""
        applies = [
            read_model_state(model, index, directory, full=self.full)
            for index, model in enumerate(models)
        ]
        for index, optimizer in enumerate(optimizers):
            inner = torch_optimizer(optimizer)
            owner = _models_of(inner, models)
            applies.append(read_optimizer_state(inner, owner, index, directory, full=self.full))

        def apply() -> None:
            for step in applies:
                step()

        return apply

    # --- pending gradients ---------------------------------------------------------------

    def pending_gradients(self, models: Sequence[Any]) -> dict[str, torch.Tensor]:
        """This rank's unreduced gradients of the open window, by position."""
        found: dict[str, torch.Tensor] = {}
        for index, fsdp_param in _fsdp_params(models):
            grad = fsdp_param.unsharded_accumulated_grad
            if grad is None:
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                grad = getattr(unsharded, "grad", None)
            if grad is not None:
                found[f"fsdp.{index}"] = grad.detach().contiguous().cpu()
            sharded = fsdp_param.sharded_param.grad
            if sharded is not None:
                found[f"shard.{index}"] = sharded.to_local().detach().contiguous().cpu()
        return found

    def restore_pending_gradients(
        self, models: Sequence[Any], grads: dict[str, torch.Tensor] | None
    ) -> None:
        """Put :meth:`pending_gradients` back (``None``: clear every gradient).

        Saved in the dtype FSDP2 accumulates in (the reduce dtype, else the parameter's), each
        unsharded gradient goes back where the next backward adds to it, as if the run had
        never stopped: ``FSDPParam.unsharded_accumulated_grad`` up to torch 2.14; from 2.15
        (``fsdp2_grad_on_unsharded_param``) the unsharded parameter's own ``.grad``, which
        exists after the first all-gather only, so units not yet gathered in this process are
        gathered and resharded first (every rank loads the same state, so every rank does).
        """
        from torch.distributed.tensor import DTensor

        grads = grads or {}
        on_param = torch_has("fsdp2_grad_on_unsharded_param")
        if on_param and any(key.startswith("fsdp.") for key in grads):
            _gather_once(models)
        device = self.engine.state.device
        for index, fsdp_param in _fsdp_params(models):
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            pending = grads.get(f"fsdp.{index}")
            if on_param:
                if unsharded is not None:
                    dtype = getattr(unsharded, "grad_dtype", None) or unsharded.dtype
                    unsharded.grad = (
                        None if pending is None else pending.to(device=device, dtype=dtype)
                    )
            else:
                if unsharded is not None:
                    unsharded.grad = None
                fsdp_param.unsharded_accumulated_grad = (
                    None if pending is None else pending.to(device)
                )
            shard = grads.get(f"shard.{index}")
            param = fsdp_param.sharded_param
            if shard is None:
                param.grad = None
            else:
                local = shard.to(device=param.device, dtype=param.dtype)
                param.grad = DTensor.from_local(
                    local, param.device_mesh, param.placements, run_check=False
                )


class TensorParallelLayout(FSDP2Layout):
    """Tensor parallelism alone: DCP folders as FSDP2's, pending gradients from the params.

    Without FSDP2 a window's gradients live in each parameter's ``.grad`` (a DTensor slice,
    or a plain tensor for the parameters the plan left alone); each rank saves its local part.
    """

    writes_in_background = False  # not tested yet under tensor parallelism alone

    def __init__(self, engine: LayoutEngine) -> None:
        super().__init__(engine, full=False)

    def pending_gradients(self, models: Sequence[Any]) -> dict[str, torch.Tensor]:
        """This rank's gradients of the open window, by model index and parameter name."""
        from torch.distributed.tensor import DTensor

        found: dict[str, torch.Tensor] = {}
        for index, model in enumerate(models):
            for name, param in model.named_parameters():
                grad = param.grad
                if grad is None:
                    continue
                local = grad.to_local() if isinstance(grad, DTensor) else grad
                found[f"tp.{index}.{name}"] = local.detach().contiguous().cpu()
        return found

    def restore_pending_gradients(
        self, models: Sequence[Any], grads: dict[str, torch.Tensor] | None
    ) -> None:
        """Put :meth:`pending_gradients` back (``None``: clear every gradient)."""
        from torch.distributed.tensor import DTensor

        grads = grads or {}
        for index, model in enumerate(models):
            for name, param in model.named_parameters():
                saved = grads.get(f"tp.{index}.{name}")
                if saved is None:
                    param.grad = None
                    continue
                if isinstance(param, DTensor):
                    local = saved.to(device=param.to_local().device, dtype=param.dtype)
                    param.grad = DTensor.from_local(
                        local, param.device_mesh, param.placements, run_check=False
                    )
                else:
                    param.grad = saved.to(device=param.device, dtype=param.dtype)


def _options(full: bool, **extra: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=full, **extra)


def save_model_state(
    model: Any, index: int, directory: Path, *, full: bool, state: dict[str, Any] | None = None
) -> None:
    """Write one FSDP2 model's state (all of it, or ``state``) in Accelerate's layout.

    A collective: every rank calls it. ``full``: rank 0 writes ``pytorch_model_fsdp[_<i>].bin``;
    else every rank writes its shards into ``pytorch_model_fsdp_<i>/`` (DCP).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if state is None:
        state = get_model_state_dict(model, options=_options(full))
    _write(state, directory, MODEL_FOLDER, "model", index, full=full)


def save_optimizer_state(
    optimizer: torch.optim.Optimizer, owner: Any, index: int, directory: Path, *, full: bool
) -> None:
    """Write one optimizer's state (its model or models: ``owner``) in Accelerate's layout.

    A collective. ``full``: rank 0 writes ``optimizer[_<i>].bin``; else ``optimizer_<i>/`` (DCP).
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state: Any = get_optimizer_state_dict(owner, optimizer, options=_options(full))
    _write(state, directory, OPTIMIZER_FOLDER, "optimizer", index, full=full)


def _write(
    state: Any,
    directory: Path,
    name: str,
    key: str,
    index: int,
    *,
    full: bool,
    group: Any = None,
) -> None:
    """Rank 0 writes ``<name>[_<i>].bin`` (``full``), else every rank ``<name>_<i>/`` (DCP).

    ``group``: the process group of DCP's collectives (the writer threads' own, when called
    from one; ``None``: the default group, or none at all with one process).
    """
    import torch.distributed.checkpoint as dcp

    if full:
        if dist.get_rank() == 0:
            _torch_save(state, directory / _indexed(name, index, ".bin"))
        return
    folder = directory / f"{name}_{index}"
    folder.mkdir(parents=True, exist_ok=True)
    alone = group is None and dist.get_world_size() == 1
    dcp.save(
        {key: state},
        storage_writer=dcp.FileSystemWriter(folder),
        process_group=group,
        no_dist=alone,
    )


def read_model_state(
    model: Any, index: int, directory: Path, *, full: bool, adapter: bool = False
) -> Callable[[], None]:
    """Read and check one model's state into a staged copy; return what applies it.

    A collective; a problem on any rank raises the same ``CheckpointError`` on every rank,
    before anything changed. ``adapter``: only the trainable parameters were saved (a peft
    model's adapters), so only those are read and applied.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    if full:
        problem: str | None = None
        state: dict[str, Any] = {}
        if dist.get_rank() == 0:
            path = directory / _indexed(MODEL_FOLDER, index, ".bin")
            problem, state = _read_full_model(path, model, trainable_only=adapter)
        _agree(problem)
        options = _options(True, broadcast_from_rank0=True, strict=not adapter)
    else:
        folder = directory / f"{MODEL_FOLDER}_{index}"
        current = get_model_state_dict(model, options=_options(False, ignore_frozen_params=adapter))
        _agree(_check_folder(folder, "model", current))
        state = {k: _clone_tree(v) for k, v in current.items()}
        dcp.load({"model": state}, storage_reader=dcp.FileSystemReader(folder))
        options = _options(False, strict=not adapter)

    def apply() -> None:
        set_model_state_dict(model, state, options=options)

    return apply


def read_optimizer_state(
    optimizer: torch.optim.Optimizer, owner: Any, index: int, directory: Path, *, full: bool
) -> Callable[[], None]:
    """Read and check one optimizer's state into a staged copy; return what applies it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    state: Any = {}
    if full:
        path = directory / _indexed(OPTIMIZER_FOLDER, index, ".bin")
        problem = None
        if dist.get_rank() == 0:
            if not path.exists():
                problem = f"{path} is missing (a FULL_STATE_DICT checkpoint of optimizer {index})"
            else:
                state = _read(path)
        _agree(problem)
        options = _options(True, broadcast_from_rank0=True)
    else:
        folder = directory / f"{OPTIMIZER_FOLDER}_{index}"
        _agree(
            None
            if folder.is_dir()
            else f"{folder} is missing: the checkpoint holds no sharded state of optimizer {index}"
        )
        state = _clone_tree(get_optimizer_state_dict(owner, optimizer))
        dcp.load({"optimizer": state}, storage_reader=dcp.FileSystemReader(folder))
        options = _options(False)

    def apply() -> None:
        set_optimizer_state_dict(owner, optimizer, optim_state_dict=state, options=options)

    return apply


def _fsdp_units(models: Sequence[Any]) -> list[tuple[str, Any, Any]]:
    """Every FSDP unit of the models that holds parameters.

    Returns:
        (stable position key, the ``FSDPModule``, its parameter group) per unit.
    """
    from torch.distributed.fsdp import FSDPModule

    found = []
    for model_index, model in enumerate(models):
        units = (module for module in model.modules() if isinstance(module, FSDPModule))
        for unit_index, module in enumerate(units):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                found.append((f"{model_index}.{unit_index}", module, group))
    return found


def _gather_once(models: Sequence[Any]) -> None:
    """Give every FSDP unit its unsharded parameters, so that they can hold gradients.

    They exist after a unit's first all-gather; a unit that has not run forward in this process
    is all-gathered and resharded here.
    """
    for _, module, group in _fsdp_units(models):
        if any(getattr(p, "_unsharded_param", None) is None for p in group.fsdp_params):
            module.unshard()
            module.reshard()


def _fsdp_params(models: Sequence[Any]) -> list[tuple[str, Any]]:
    """Every FSDP parameter of the models, with a stable position key."""
    return [
        (f"{unit}.{param_index}", fsdp_param)
        for unit, _, group in _fsdp_units(models)
        for param_index, fsdp_param in enumerate(group.fsdp_params)
    ]


def _clone_tree(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone_tree(v) for v in value]
    return value


def _torch_save(obj: Any, path: Path) -> None:
    from accel_state.files import fsync_file as _fsync_path

    torch.save(obj, path)
    _fsync_path(path)


def _read(path: Path) -> Any:
    try:
        return _safe_load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise _checkpoint_error(f"{path} is corrupt or unreadable: {error}") from error


def _read_full_model(
    path: Path, model: Any, *, trainable_only: bool = False
) -> tuple[str | None, dict[str, Any]]:
    if not path.exists():
        return f"{path} is missing (a FULL_STATE_DICT checkpoint of an FSDP2 model)", {}
    try:
        state = _safe_load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any failure to read means a bad file
        return f"{path} is corrupt or unreadable: {error}", {}
    expected = {
        k: tuple(v.shape) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)
    }
    if trainable_only:
        trainable = {name for name, param in model.named_parameters() if param.requires_grad}
        expected = {k: shape for k, shape in expected.items() if k in trainable}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        return (
            f"{path} does not fit the prepared model: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}",
            {},
        )
    for key, shape in expected.items():
        if tuple(state[key].shape) != shape:
            return (
                f"{path}: tensor {key!r} has shape {tuple(state[key].shape)} in the checkpoint "
                f"but {shape} in the model (a checkpoint of another model?)",
                {},
            )
    return None, state


def _check_folder(folder: Path, key: str, current: dict[str, Any]) -> str | None:
    """Whether a DCP folder exists and holds every tensor of ``current`` with its shape."""
    import torch.distributed.checkpoint as dcp

    if not (folder / ".metadata").is_file():
        return (
            f"{folder} is not a sharded (DCP) checkpoint: it has no .metadata file. Was it "
            "saved with FULL_STATE_DICT? Then set the plugin's state_dict_type to match"
        )
    try:
        metadata = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    except Exception as error:  # noqa: BLE001 - any failure to read means a bad file
        return f"{folder}/.metadata is corrupt: {error}"
    missing = []
    for name, value in current.items():
        entry = metadata.get(f"{key}.{name}")
        if entry is None:
            missing.append(name)
            continue
        size = getattr(entry, "size", None)
        if (
            size is not None
            and isinstance(value, torch.Tensor)
            and tuple(size) != tuple(value.shape)
        ):
            return (
                f"{folder}: tensor {name!r} has shape {tuple(size)} in the checkpoint but "
                f"{tuple(value.shape)} in the model (a checkpoint of another model?)"
            )
    if missing:
        return f"{folder} lacks tensors of the model: {missing[:5]}"
    return None
