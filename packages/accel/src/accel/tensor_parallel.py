"""Tensor parallelism: shard a model's layers over the ``tp`` dimension of a device mesh.

A tensor-parallel model holds each sharded layer's weight as a ``DTensor``: every rank of the
``tp`` group owns a slice, and the layer's forward exchanges activations so that the rest of
the model sees whole tensors. accel trains such a model (``ParallelismConfig(tp_size=...)``,
alone or with FSDP2 over the data-parallel dimensions); it is sharded before ``prepare``:

* by the user, with torch's ``parallelize_module(model, accelerator.torch_device_mesh["tp"],
  plan)`` and ``ParallelStyle`` objects;
* with :func:`apply_tensor_parallel`, from a plan of names (transformers' spelling) or the
  plan the model carries (a transformers model's ``config.base_model_tp_plan`` and
  ``_tp_plan``).

The names :func:`apply_tensor_parallel` understands (:data:`TENSOR_PARALLEL_STYLES`), each a
torch ``ParallelStyle``:

========================  =====================================================================
``"colwise"``             ``ColwiseParallel()``: the weight split by output features; the input
                          whole, the output split along its last dimension (the next layer
                          should be ``"rowwise"``).
``"rowwise"``             ``RowwiseParallel()``: the weight split by input features; the input
                          split along its last dimension, the output summed over the group.
``"colwise_rep"``         ``ColwiseParallel(output_layouts=Replicate())``: as ``"colwise"``,
(``"colwise_gather_output"``)  with the output gathered whole (a language model's head).
``"rowwise_rep"``         ``RowwiseParallel(input_layouts=Replicate())``: as ``"rowwise"``, with
(``"embedding_rowwise"``)  a whole input that each rank slices itself; on an ``nn.Embedding``
                          the vocabulary is split (each rank looks up its rows, the results
                          are summed).
``"sequence_parallel"``   ``SequenceParallel()``: a norm or dropout whose activations are split
                          along the sequence dimension (dimension 1).
========================  =====================================================================

Plan keys are module names relative to the model, ``*`` matching one name segment
(``"layers.*.mlp.up_proj"``). Unlike torch (which warns and skips), a key that matches no
module, a style name that is not one of the above, or a layer whose sharded dimension the
``tp`` size does not divide is an error raised before any layer is sharded.

With FSDP2 the parameters the plan left alone (norms, embeddings...) become replicated
``DTensor`` parameters on ``tp`` (:func:`replicate_remaining_parameters`), so FSDP2 shards one
kind of parameter; their modules take and return plain tensors as before. Such a parameter
must be used inside its own module's forward (a weight reused elsewhere, as tied embeddings
are, cannot be replicated this way: tie after sharding, or shard that module too).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "TENSOR_PARALLEL_STYLES",
    "apply_tensor_parallel",
    "model_plan",
    "replicate_remaining_parameters",
    "tensor_parallel_mesh_of",
    "tensor_parallel_plan",
]

#: The plan names :func:`apply_tensor_parallel` understands, with what each does.
TENSOR_PARALLEL_STYLES: dict[str, str] = {
    "colwise": "ColwiseParallel(): weight split by output features, output split",
    "rowwise": "RowwiseParallel(): weight split by input features, output summed",
    "colwise_rep": "ColwiseParallel(output_layouts=Replicate()): output gathered whole",
    "colwise_gather_output": "the same as colwise_rep (transformers' name)",
    "rowwise_rep": "RowwiseParallel(input_layouts=Replicate()): whole input, sliced per rank",
    "embedding_rowwise": "RowwiseParallel(input_layouts=Replicate()) on an embedding: vocab split",
    "sequence_parallel": "SequenceParallel(): activations split along the sequence dimension",
}

# Which dimension of a weight each name splits (nn.Linear's weight is (out, in)), for the
# divisibility check; None: no weight split.
_SPLIT_DIM = {
    "colwise": 0,
    "colwise_rep": 0,
    "colwise_gather_output": 0,
    "rowwise": 1,
    "rowwise_rep": 1,
    "embedding_rowwise": 1,
    "sequence_parallel": None,
}


def _style(name: str) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel()
    if name in ("colwise_rep", "colwise_gather_output"):
        return ColwiseParallel(output_layouts=Replicate())
    if name in ("rowwise_rep", "embedding_rowwise"):
        return RowwiseParallel(input_layouts=Replicate())
    return SequenceParallel()


def tensor_parallel_plan(plan: Mapping[str, Any]) -> dict[str, Any]:
    """``plan`` with every style name replaced by its torch ``ParallelStyle``.

    Raises:
        TypeError: ``plan`` is not a mapping, or a value is neither a name nor a
            ``ParallelStyle``.
        ValueError: a name is not one of :data:`TENSOR_PARALLEL_STYLES`.
    """
    from torch.distributed.tensor.parallel import ParallelStyle

    if not isinstance(plan, Mapping):
        raise TypeError(
            f"plan={plan!r}: expected a dict of module name patterns to style names "
            "('colwise', 'rowwise', ...) or torch ParallelStyle objects"
        )
    styles: dict[str, Any] = {}
    for key, value in plan.items():
        if isinstance(value, ParallelStyle):
            styles[key] = value
        elif isinstance(value, str):
            if value not in TENSOR_PARALLEL_STYLES:
                raise ValueError(
                    f"plan[{key!r}]={value!r} is not a style accel knows; choose one of "
                    f"{', '.join(TENSOR_PARALLEL_STYLES)}, or pass a torch ParallelStyle object "
                    "(torch.distributed.tensor.parallel) for this module"
                )
            styles[key] = _style(value)
        else:
            raise TypeError(
                f"plan[{key!r}]={value!r}: expected a style name ("
                f"{', '.join(TENSOR_PARALLEL_STYLES)}) or a torch ParallelStyle object"
            )
    return styles


def model_plan(model: torch.nn.Module) -> dict[str, Any] | None:
    """The tensor-parallel plan a (transformers) model carries, keyed from ``model``; or None.

    The base model's plan (``config.base_model_tp_plan``, or the base model's ``_tp_plan``)
    under the base model's attribute name, then the head's ``_tp_plan`` (``"lm_head"``...).
    """
    plan: dict[str, Any] = {}
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, prefix, None) if prefix else None
    base_plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if not base_plan and isinstance(base, torch.nn.Module):
        base_plan = getattr(base, "_tp_plan", None)
    if base_plan:
        lead = f"{prefix}." if isinstance(base, torch.nn.Module) and base is not model else ""
        plan.update({f"{lead}{key}": value for key, value in dict(base_plan).items()})
    own = getattr(model, "_tp_plan", None)
    if isinstance(own, Mapping) and own is not base_plan:
        plan.update(dict(own))
    return plan or None


def _matches(model: torch.nn.Module, pattern: str) -> list[tuple[str, torch.nn.Module]]:
    """The modules ``pattern`` names (``*`` matching one segment), as parallelize_module does."""
    if pattern == "":
        return [("", model)]
    tokens = pattern.split(".")
    found = []
    for name, module in model.named_modules():
        parts = name.split(".") if name else []
        if len(parts) == len(tokens) and all(
            fnmatch.fnmatch(part, token) for part, token in zip(parts, tokens, strict=True)
        ):
            found.append((name, module))
    return found


def _tp_mesh(device_mesh: Any) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(
            f"device_mesh={device_mesh!r}: expected a torch DeviceMesh (the run's mesh, "
            "accelerator.torch_device_mesh, or its ['tp'] dimension)"
        )
    names = device_mesh.mesh_dim_names or ()
    if device_mesh.ndim == 1:
        return device_mesh
    if "tp" in names:
        return device_mesh["tp"]
    raise ValueError(
        f"device_mesh has {device_mesh.ndim} dimensions {names} and none is named 'tp': pass "
        "the tensor-parallel dimension (accelerator.torch_device_mesh['tp'])"
    )


def _check_divisible(name: str, module: torch.nn.Module, style: str, size: int) -> str | None:
    dim = _SPLIT_DIM.get(style)
    weight = getattr(module, "weight", None)
    if dim is None or not isinstance(weight, torch.Tensor) or weight.dim() < 2:
        return None
    if isinstance(module, torch.nn.Embedding):
        dim = 1 - dim  # an embedding's weight is (num_embeddings, embedding_dim)
    if weight.shape[dim] % size:
        return (
            f"{name or 'the model'} ({type(module).__name__}, weight {tuple(weight.shape)}): "
            f"{style!r} splits dimension {dim} ({weight.shape[dim]}) over tp_size={size}, "
            "which does not divide it"
        )
    return None


def apply_tensor_parallel(
    model: torch.nn.Module, device_mesh: Any, plan: Mapping[str, Any] | None = None
) -> torch.nn.Module:
    """Shard ``model``'s layers over ``device_mesh`` (its ``tp`` dimension) by ``plan``.

    Args:
        model: The model to shard, in place (each rank builds the same model; the weights
            are taken from rank 0).
        device_mesh: The tensor-parallel mesh, or the run's whole mesh
            (``accelerator.torch_device_mesh``), whose ``tp`` dimension is then used.
        plan: Module name patterns to style names (:data:`TENSOR_PARALLEL_STYLES`) or torch
            ``ParallelStyle`` objects; None: the plan the model carries (:func:`model_plan`).

    Returns:
        ``model``, its planned layers holding ``DTensor`` weights.

    Raises:
        ValueError: no plan given and the model carries none; a key matching no module; a
            style name accel does not know; a layer the ``tp`` size cannot split evenly; a
            model already sharded.
        TypeError: ``device_mesh`` is not a ``DeviceMesh``; a plan value of the wrong type.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = _tp_mesh(device_mesh)
    if plan is None:
        plan = model_plan(model)
        if plan is None:
            raise ValueError(
                f"apply_tensor_parallel({type(model).__name__}): the model carries no tensor "
                "parallel plan (no config.base_model_tp_plan or _tp_plan); pass plan={module "
                "pattern: style} with styles from accel.utils.TENSOR_PARALLEL_STYLES"
            )
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError(
            f"apply_tensor_parallel({type(model).__name__}): the model already holds DTensor "
            "parameters (sharded before); apply a plan once, to a model of plain tensors"
        )
    styles = tensor_parallel_plan(plan)
    size = mesh.size()
    problems = []
    for key, value in plan.items():
        targets = _matches(model, key)
        if not targets:
            problems.append(f"{key!r} matches no module of {type(model).__name__}")
        for name, module in targets if isinstance(value, str) else ():
            problem = _check_divisible(name, module, value, size)
            if problem:
                problems.append(problem)
    if problems:
        raise ValueError(
            "apply_tensor_parallel: the plan does not fit the model, nothing was sharded: "
            + "; ".join(problems[:5])
        )
    parallelize_module(model, mesh, styles)
    return model


def tensor_parallel_mesh_of(model: torch.nn.Module) -> Any:
    """The mesh of ``model``'s DTensor parameters (None: the model holds none).

    Raises:
        ValueError: the DTensor parameters live on different meshes.
    """
    from torch.distributed.tensor import DTensor

    meshes = {}
    for param in model.parameters():
        if isinstance(param, DTensor):
            meshes[id(param.device_mesh)] = param.device_mesh
    if len(meshes) > 1:
        found = ", ".join(str(m.mesh_dim_names) for m in meshes.values())
        raise ValueError(
            f"{type(model).__name__}'s DTensor parameters live on {len(meshes)} meshes "
            f"({found}); shard the model over one tensor-parallel mesh"
        )
    return next(iter(meshes.values()), None)


def _to_replicated(value: Any, mesh: Any) -> Any:
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
        return value
    return DTensor.from_local(value, mesh, [Replicate()], run_check=False)


def _to_local(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, tuple | list):
        return type(value)(_to_local(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_local(v) for k, v in value.items()}
    return value


def replicate_remaining_parameters(model: torch.nn.Module, mesh: Any) -> list[str]:
    """Make every plain parameter of ``model`` a replicated ``DTensor`` on ``mesh``.

    A module whose own parameters were all plain gets forward hooks: its tensor inputs enter
    as replicated DTensors and its outputs leave as plain tensors, so the modules around it
    see what they saw before. Returns the names of the parameters replaced.
    """
    from torch.distributed.tensor import DTensor

    replaced = []
    for module_name, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        plain = [(name, p) for name, p in own if not isinstance(p, DTensor)]
        if not plain:
            continue
        for name, param in plain:
            replicated = torch.nn.Parameter(
                _to_replicated(param.data, mesh), requires_grad=param.requires_grad
            )
            module.register_parameter(name, replicated)
            replaced.append(f"{module_name}.{name}" if module_name else name)
        if len(plain) == len(own):
            module.register_forward_pre_hook(_replicate_inputs(mesh), with_kwargs=True)
            module.register_forward_hook(_local_outputs)
    return replaced


def _replicate_inputs(mesh: Any) -> Any:
    def hook(
        module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (
            tuple(_to_replicated(a, mesh) for a in args),
            {k: _to_replicated(v, mesh) for k, v in kwargs.items()},
        )

    return hook


def _local_outputs(module: torch.nn.Module, args: Any, output: Any) -> Any:
    return _to_local(output)
