"""FSDP2: every rank holds a 1/N shard of each parameter, gradient and optimizer state.

Built on ``torch.distributed.fsdp.fully_shard``. ``prepare`` shards the model in place, unit
by unit (the modules the wrap policy picks, bottom-up, then the root), so a unit's weights are
all-gathered just before its forward and freed after it. The steps, in order:

1. refuse what cannot be sharded (a model dispatched by a device map);
2. with mixed precision, upcast trainable parameters to fp32 (the shards are the fp32 master
   weights; ``MixedPrecisionPolicy`` casts for compute);
3. record every parameter by name, so an optimizer built on the unsharded model is re-pointed
   to the shards, whether it is prepared in the same call or later;
4. with ``cpu_ram_efficient_loading``, keep rank 0's weights and move the model to ``meta``;
5. activation checkpointing on the policy's units;
6. ``fully_shard`` each unit, then the root; a unit whose parameters are tied to parameters
   outside it is not made a unit (the tie then lives in the enclosing unit);
7. with ``cpu_ram_efficient_loading``, materialise the shards and broadcast rank 0's weights.

Gradients are reduce-scattered averaged over the mesh; ``no_sync`` uses
``set_requires_gradient_sync(False)``; clipping, full state dicts and model files are the
DTensor engines' (:mod:`accel.engines.dtensor`). Checkpoints: see
:mod:`accel.engines.fsdp2_checkpoint`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from accel_amp import HasAveragingGroup
from accel_state import DistributedType
from accel_state.process_group import release_mesh_groups

from .base import EngineOptions
from .dtensor import DTensorEngine

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["FSDP2Engine", "canonical_name", "fsdp2_canonicalize_names", "get_fsdp2_grad_scaler"]

logger = logging.getLogger("accel.engines.fsdp2")

_AC_PREFIX = "_checkpoint_wrapped_module."


def canonical_name(name: str) -> str:
    """A parameter name without the activation-checkpointing and compile wrappers' parts."""
    return name.replace(_AC_PREFIX, "").replace("_orig_mod.", "")


def fsdp2_canonicalize_names(named_params: dict[str, Any]) -> dict[str, Any]:
    """``named_params`` with the activation-checkpointing and compile wrappers' parts removed."""
    return {canonical_name(name): value for name, value in named_params.items()}


def get_fsdp2_grad_scaler(**kwargs: Any) -> torch.amp.GradScaler:
    """The fp16 loss scaler for FSDP2: torch's ``GradScaler``, which handles DTensor grads."""
    from accel_state import PartialState

    return torch.amp.GradScaler(PartialState().device.type, **kwargs)


def _is_container(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.ModuleList | torch.nn.ModuleDict) or (
        type(module).forward is torch.nn.Module.forward
    )


class FSDP2Engine(DTensorEngine, HasAveragingGroup):
    """Fully sharded data parallel training with ``fully_shard`` (see the module docstring).

    Raises:
        ValueError: the plugin asks for FSDP1, or ``CPUOffloadPolicy`` on a CPU-only run.
    """

    name = "FSDP2"
    is_fsdp2 = True
    autocasts_forward = False
    places_optimizer_state = False

    def __init__(self, options: EngineOptions) -> None:
        super().__init__(options)
        from torch.distributed.fsdp import CPUOffloadPolicy

        plugin = options.fsdp_plugin
        if plugin is None:
            raise ValueError("the FSDP2 engine needs a FullyShardedDataParallelPlugin")
        self.plugin = plugin
        device = self.state.device
        if isinstance(plugin.cpu_offload, CPUOffloadPolicy) and device.type == "cpu":
            raise ValueError(
                "FullyShardedDataParallelPlugin(cpu_offload=True) (CPUOffloadPolicy) keeps the "
                "shards on the CPU and computes on an accelerator, but this run computes on the "
                "CPU, where torch cannot use it ('Cannot access accelerator device when none is "
                "available'). Set cpu_offload=False (FSDP_OFFLOAD_PARAMS=false) on CPU runs"
            )
        if plugin.activation_checkpointing_offload and device.type == "cpu":
            raise ValueError(
                "FullyShardedDataParallelPlugin(activation_checkpointing_offload=True) moves "
                "checkpointed activations from the accelerator to pinned CPU memory, but this run "
                "computes on the CPU, where there is nothing to offload (and no pinned memory). "
                "Set activation_checkpointing_offload=False "
                "(FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD=false) on CPU runs"
            )
        if plugin.mixed_precision_policy is None and options.policy.mixed_precision != "no":
            # On the plugin once the Accelerator exists, as in Accelerate.
            plugin.set_mixed_precision(options.policy.mixed_precision)
        self._own_group = False
        if not dist.is_initialized():
            # One process without a launcher: FSDP2 still needs a (one-rank) process group.
            backend = (
                "gloo"
                if device.type == "cpu"
                else dist.Backend.default_device_backend_map.get(device.type, "gloo")
            )
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            self._own_group = True
        from torch.distributed.device_mesh import init_device_mesh

        config = getattr(self.state, "parallelism_config", None)
        # The run's whole mesh (a ParallelismConfig's; the Accelerator owns and releases it),
        # or None: FSDP2 then builds its own.
        root_mesh = getattr(self.state, "device_mesh", None) if config is not None else None
        if config is not None and root_mesh is not None:
            # (dp_replicate, dp_shard) for HSDP, else dp_shard (accel.parallelism). With context
            # parallelism it is the flattened dp_shard_cp; without, that is dp_shard itself,
            # and slicing the real dimensions draws no torch warning.
            names = config.fsdp_dim_names if config.cp_enabled else config.dp_dim_names
            self.mesh = root_mesh[tuple(names)]
        else:
            self.mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        # Tensor parallelism: models arrive sharded over this mesh (accel.tensor_parallel).
        self.tp_mesh = (
            root_mesh["tp"]
            if config is not None and root_mesh is not None and config.tp_enabled
            else None
        )
        # id(original parameter) -> (weak references to it and its model, parameter name);
        # weak, so a model the user drops (or free_memory forgets) is not kept alive here.
        self._origins: dict[int, tuple[weakref.ref[Any], weakref.ref[Any], str]] = {}

    @property
    def distributed_type(self) -> DistributedType:
        """Always ``FSDP``."""
        return DistributedType.FSDP

    @property
    def multi_device(self) -> bool:
        """Several GPU-like devices."""
        return self.state.device.type != "cpu" and dist.get_world_size() > 1

    def grad_scaler(self, **kwargs: Any) -> Any:
        """Torch's ``GradScaler`` (it handles DTensor gradients)."""
        return torch.amp.GradScaler(self.state.device.type, **kwargs)

    # --- prepare -------------------------------------------------------------------------

    def check_prepare(self, objects: Sequence[Any]) -> None:
        """Refuse models dispatched by a device map (their weights live on several devices).

        Raises:
            ValueError: naming the model's device map and the fix.
        """
        for obj in objects:
            if not isinstance(obj, torch.nn.Module):
                continue
            device_map = getattr(obj, "hf_device_map", None)
            if isinstance(device_map, dict) and (
                len(set(map(str, device_map.values()))) > 1
                or "disk" in map(str, device_map.values())
            ):
                raise ValueError(
                    f"prepare() got a {type(obj).__name__} dispatched by a device map "
                    f"(hf_device_map={device_map!r}): FSDP2 shards a model that lives whole on "
                    "each process's device. Load it without device_map (or with "
                    "device_map={'': <this process's device>})"
                )

    def prepare_model(
        self, model: torch.nn.Module, *, device_placement: bool, evaluation_mode: bool
    ) -> torch.nn.Module:
        """Shard ``model`` in place (see the module docstring); return it."""
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            return model
        plugin = self.plugin
        mp_policy = self._precision_policy()
        predicate = plugin.set_auto_wrap_policy(model)  # validates class names first
        ignored = plugin.ignored_parameters(model)
        self._keep_trainable_in_float32(model)
        placed = False
        if self.tp_mesh is not None and device_placement:
            # Before the weak references below: moving DTensor parameters swaps tensors,
            # which a weakly referenced tensor refuses.
            model.to(self.state.device)
            placed = True
        model_ref = weakref.ref(model)
        for name, param in model.named_parameters():
            self._origins[id(param)] = (weakref.ref(param), model_ref, name)
        if self.tp_mesh is not None:
            self._replicate_beside_tensor_parallel(model)
        config = getattr(self.state, "parallelism_config", None)
        if config is not None and config.cp_enabled:
            from accel.context_parallel import prepare_context_parallel

            prepare_context_parallel(model, config)

        full_state: dict[str, torch.Tensor] | None = None
        buffers: dict[str, torch.Tensor] = {}
        if plugin.cpu_ram_efficient_loading:
            full_state, buffers = self._release_weights(model)
        elif device_placement and not placed:
            model.to(self.state.device)
        self._shard(model, self._wrapped_units(model, predicate), mp_policy, ignored)
        if plugin.cpu_ram_efficient_loading:
            self._load_full_state(model, full_state, buffers)
        return self.compile_model(model)

    def _wrapped_units(self, model: torch.nn.Module, predicate: Any) -> list[torch.nn.Module]:
        """The modules sharded before the root, checkpointed when the plugin asks."""
        units = self._units(model, predicate)
        if predicate is None and dist.get_rank() == 0:
            logger.warning(
                "FSDP2 without a wrap policy (NO_WRAP, or SIZE_BASED_WRAP with min_num_params "
                "unset or 0): the whole model is one unit, all-gathered at once for forward and "
                "backward (only gradients and optimizer state at rest are sharded). Set "
                "auto_wrap_policy to TRANSFORMER_BASED_WRAP, or SIZE_BASED_WRAP with "
                "min_num_params > 0 (accel launch --fsdp_min_num_params), to shard layer by layer"
            )
        if self.plugin.activation_checkpointing:
            units = self._checkpoint_units(model, units)
        return units

    def _precision_policy(self) -> MixedPrecisionPolicy:
        """The plugin's mixed-precision policy (set from the run's precision when it has none)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        plugin = self.plugin
        precision = self.options.policy.mixed_precision
        if plugin.mixed_precision_policy is None and precision != "no":
            plugin.set_mixed_precision(precision)
        return plugin.mixed_precision_policy or MixedPrecisionPolicy()

    def _keep_trainable_in_float32(self, model: torch.nn.Module) -> None:
        """Under mixed precision, trainable parameters are float32 (the policy casts them)."""
        if self.options.policy.mixed_precision == "no":
            return
        for param in model.parameters():
            if param.requires_grad and param.dtype != torch.float32:
                param.data = param.data.to(torch.float32)

    def _shard(
        self,
        model: torch.nn.Module,
        units: list[torch.nn.Module],
        mp_policy: MixedPrecisionPolicy,
        ignored: set[torch.nn.Parameter],
    ) -> None:
        """``fully_shard`` every unit, then the root (activation checkpointing first)."""
        from torch.distributed.fsdp import fully_shard

        plugin = self.plugin
        kwargs: dict[str, Any] = {
            "mesh": self.mesh,
            "reshard_after_forward": plugin.reshard_after_forward,
            "mp_policy": mp_policy,
            "offload_policy": plugin.cpu_offload,
        }
        if ignored:
            kwargs["ignored_params"] = ignored
        # Inner units return their compute dtype (the next unit or the root's layers consume
        # it); only the root casts its outputs to the policy's output dtype.
        inner = dataclasses.replace(mp_policy, output_dtype=None)
        for unit in units:
            fully_shard(unit, **{**kwargs, "mp_policy": inner})
        root_kwargs = {k: v for k, v in kwargs.items() if k != "reshard_after_forward"}
        fully_shard(model, **root_kwargs)

    def _replicate_beside_tensor_parallel(self, model: torch.nn.Module) -> None:
        """Check ``model`` is sharded over the run's ``tp`` mesh; replicate its other params.

        Raises:
            ValueError: the model holds no DTensor, or holds them on another mesh; with
                ``cpu_ram_efficient_loading`` (rank 0's full weights cannot fill TP shards).
        """
        from accel.tensor_parallel import replicate_remaining_parameters, tensor_parallel_mesh_of

        tp_mesh = self.tp_mesh
        assert tp_mesh is not None
        found = tensor_parallel_mesh_of(model)
        if found is None:
            raise ValueError(
                f"prepare(): ParallelismConfig(tp_size={tp_mesh.size()}) but "
                f"{type(model).__name__} is not tensor parallel (no DTensor parameter). Shard "
                "it before prepare(): accel.utils.apply_tensor_parallel(model, "
                "accelerator.torch_device_mesh, plan), or torch's parallelize_module on "
                "accelerator.torch_device_mesh['tp']"
            )
        if found != tp_mesh:
            raise ValueError(
                f"prepare(): {type(model).__name__} is sharded over a mesh "
                f"{found.mesh_dim_names} {found.mesh.tolist()}, not over this run's 'tp' "
                f"dimension {tp_mesh.mesh.tolist()}: shard it over "
                "accelerator.torch_device_mesh['tp']"
            )
        if self.plugin.cpu_ram_efficient_loading:
            raise ValueError(
                "FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=True) with tensor "
                "parallelism: rank 0's full weights cannot be broadcast into tensor-parallel "
                "slices. Set cpu_ram_efficient_loading=False (FSDP_CPU_RAM_EFFICIENT_LOADING="
                "false); apply_tensor_parallel already takes every slice from rank 0"
            )
        replicate_remaining_parameters(model, tp_mesh)

    def _units(self, model: torch.nn.Module, predicate: Any) -> list[torch.nn.Module]:
        """The modules sharded as their own unit, children before parents, root excluded."""
        if predicate is None:
            return []
        from accel.models import get_module_children_bottom_up

        users: dict[int, set[int]] = {}
        for module in model.modules():
            for param in module.parameters(recurse=False):
                users.setdefault(id(param), set()).add(id(module))
        taken: set[int] = set()
        units = []
        for module in get_module_children_bottom_up(model):
            if module is model or _is_container(module):
                continue
            if not predicate(module, taken):
                continue
            inside = {id(m) for m in module.modules()}
            params = {id(p) for p in module.parameters()}
            if any(users[p] - inside for p in params):
                logger.info(
                    f"FSDP2: {type(module).__name__} shares parameters with modules outside it "
                    "(tied weights); it stays in its parent's unit"
                )
                continue
            units.append(module)
            taken |= params
        return units

    def _checkpoint_units(
        self, model: torch.nn.Module, units: list[torch.nn.Module]
    ) -> list[torch.nn.Module]:
        """Wrap each unit in ``checkpoint_wrapper`` (in its parent); return the wrappers."""
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            checkpoint_wrapper,
            offload_wrapper,
        )

        if not units:
            logger.warning(
                "FSDP2 activation_checkpointing applies to the wrap policy's units, and there "
                "are none (NO_WRAP): no activation is recomputed"
            )
            return units
        wanted = {id(unit) for unit in units}
        wrappers = {}
        for parent in list(model.modules()):
            for child_name, child in list(parent.named_children()):
                if id(child) in wanted:
                    if self.plugin.activation_checkpointing_offload:
                        wrapper = offload_wrapper(child)
                    else:
                        wrapper = checkpoint_wrapper(
                            child,
                            checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                            preserve_rng_state=False,
                        )
                    setattr(parent, child_name, wrapper)
                    wrappers[id(child)] = wrapper
        return [wrappers.get(id(unit), unit) for unit in units]

    def _release_weights(
        self, model: torch.nn.Module
    ) -> tuple[dict[str, torch.Tensor] | None, dict[str, torch.Tensor]]:
        """Keep rank 0's full weights (and non-persistent buffers); move the model to meta."""
        rank = dist.get_rank()
        persistent = set(model.state_dict().keys())
        buffers = {
            name: buffer.detach().clone()
            for name, buffer in model.named_buffers()
            if name not in persistent and rank == 0 and buffer.device.type != "meta"
        }
        full_state = None
        if rank == 0:
            state = model.state_dict()
            meta = [k for k, v in state.items() if v.device.type == "meta"]
            if meta:
                raise ValueError(
                    "cpu_ram_efficient_loading: rank 0 must hold the model's weights, but "
                    f"{meta[:3]} are on the meta device. Build the model with its weights on "
                    "rank 0 (other ranks may use init_empty_weights)"
                )
            full_state = {k: v.detach() for k, v in state.items()}
        model.to("meta")
        return full_state, buffers

    def _load_full_state(
        self,
        model: torch.nn.Module,
        full_state: dict[str, torch.Tensor] | None,
        buffers: dict[str, torch.Tensor],
    ) -> None:
        """Materialise the shards and fill them from rank 0's weights (a broadcast)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        device = self.state.device
        model.to_empty(device=device)
        set_model_state_dict(
            model,
            cast(Any, full_state if full_state is not None else {}),
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )
        persistent = set(model.state_dict().keys())
        for name, buffer in model.named_buffers():
            if name in persistent:
                continue
            if dist.get_rank() == 0:
                buffer.copy_(buffers[name].to(device))
            dist.broadcast(buffer.data, src=0)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Re-point ``optimizer`` from the unsharded parameters to their shards, state kept.

        Raises:
            ValueError: a parameter is neither a shard nor a parameter of a prepared model
                (the optimizer was prepared before its model).
        """
        from torch.distributed.tensor import DTensor, distribute_tensor

        plan: list[list[torch.Tensor]] = []
        for index, group in enumerate(optimizer.param_groups):
            replaced = []
            for position, param in enumerate(group["params"]):
                new = self._sharded_counterpart(param)
                if new is None:
                    raise ValueError(
                        f"prepare(): the optimizer's parameter {position} of param group "
                        f"{index} (shape {tuple(param.shape)}) belongs to no model prepared "
                        "with FSDP2. Prepare the model first (or in the same prepare() call as "
                        "the optimizer): its parameters are replaced by shards, and an "
                        "optimizer over the old ones would not train"
                    )
                replaced.append(new)
            plan.append(replaced)
        for group, replaced in zip(optimizer.param_groups, plan, strict=True):
            for old, new in zip(group["params"], replaced, strict=True):
                if old is new:
                    continue
                state = optimizer.state.pop(old, None)
                if state:
                    optimizer.state[new] = {
                        key: (
                            distribute_tensor(value.to(new.device), new.device_mesh, new.placements)
                            if isinstance(new, DTensor)
                            and isinstance(value, torch.Tensor)
                            and value.shape == old.shape
                            and value.dim() > 0
                            else value
                        )
                        for key, value in state.items()
                    }
            group["params"] = replaced
        return optimizer

    def _sharded_counterpart(self, param: torch.Tensor) -> torch.Tensor | None:
        from torch.distributed.tensor import DTensor

        origin = self._origins.get(id(param))
        if origin is None or origin[0]() is not param:
            # Already a shard (or a tensor-parallel slice of no model prepared here).
            return param if isinstance(param, DTensor) else None
        _, model_ref, name = origin
        model = model_ref()
        if model is None:
            return None
        for current, candidate in model.named_parameters():
            if canonical_name(current) == name:
                return candidate
        return None

    def forget_model(self, model: torch.nn.Module) -> None:
        """Drop the recorded names of ``model``'s original parameters."""
        self._origins = {k: v for k, v in self._origins.items() if v[1]() is not model}

    # --- the step ------------------------------------------------------------------------

    def grads_averaged_over(self, model: Any) -> int:
        """The size of the mesh FSDP2 averages gradients over (every rank but ``tp`` peers)."""
        return int(self.mesh.size())

    def averaging_group(self, model: Any) -> Any:
        """The group of those ranks: the flattened data(-and-context) dimension beside ``tp``.

        None (the default group) without tensor parallelism, where they are every rank.
        """
        if self.tp_mesh is None:
            return None
        config = self.state.parallelism_config
        root = self.state.device_mesh
        return root["dp_cp" if config.cp_enabled else "dp"].get_group()

    @contextlib.contextmanager
    def no_sync(self, model: Any) -> Iterator[None]:
        """``set_requires_gradient_sync(False)`` inside the block."""
        toggle = getattr(model, "set_requires_gradient_sync", None)
        if not callable(toggle):
            yield
            return
        toggle(False)
        try:
            yield
        finally:
            toggle(True)

    # --- models and checkpoints --------------------------------------------------------

    def checkpoint_layout(self) -> Any:
        """Accelerate's FSDP layout (sharded DCP folders, or full files on rank 0)."""
        from .fsdp2_checkpoint import FSDP2Layout

        return FSDP2Layout(self, full=bool(self.plugin.full_state_dict))

    def teardown(self) -> None:
        """Let go of the meshes' process groups; destroy the one-rank group this engine made.

        Dropping the meshes' references (``release_mesh_groups``) lets the groups, and their
        gloo threads, go with the prepared models instead of reaching interpreter exit.
        """
        release_mesh_groups(self.mesh)
        if self._own_group and dist.is_initialized():
            dist.destroy_process_group()
            self._own_group = False
