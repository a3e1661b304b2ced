"""The prefetching materialiser: follows the model's block order and loads the next units.

See the package documentation (:mod:`accel_bigmodel.prefetch`) for the order, the memory
bound and the failure behaviour.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import logging
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from accel_bigmodel.hooks import (
    AlignDevicesHook,
    materialize_weights,
    release_weights,
    set_weight_materializer,
)
from accel_bigmodel.tensors import castable

from .copy_api import CopyApi, CopyEvent, CudaCopyApi
from .cuda_staging import StagedItem, StagedWeights, StagingPool, cuda_device, stageable
from .depth import DEFAULT_PREFETCH_DEPTH, check_prefetch_depth
from .paging import PAGER, check_files
from .plan import Plan, Unit, combine_plans, find_units, has_offloaded_weights, hook_plan
from .staging_mode import StagingMode, resolve_copy_threads, resolve_staging_mode
from .worker import Worker

logger = logging.getLogger(__name__)

PACE_UNITS = 2
"""How many units the host may run ahead of the GPU's compute once staging is in use."""

_Staging = tuple[tuple[AlignDevicesHook, torch.device], ...]
"""``(hook, CUDA device with its index)`` for each hook whose weights are staged to a device."""


class _Prefetch:
    """One scheduled prefetch of a unit; ``result`` is set once the engine has taken it."""

    __slots__ = ("failed", "future", "result", "unit")

    def __init__(self, unit: Unit, future: concurrent.futures.Future[StagedWeights]) -> None:
        self.unit = unit
        self.future = future
        self.result: StagedWeights | None = None
        self.failed = False


class _Binding:
    """All the engine knows about the model it is bound to; ``close`` drops it whole.

    Args:
        model: the bound model (held weakly).
        units: its prefetch units, in the device map's order.

    Attributes:
        handles: the model's forward hooks that tell the engine where forwards start and end.
        order: the units in the order the last full forward ran them (``None``: no forward yet).
        seen: the units the running forward has started, in order.
        forward_depth: how many forwards of the model are running (nested calls count).
        synchronous_rest: the running forward left the order: load the rest synchronously.
        inflight: prefetches scheduled ahead, by their position in the order.
        current: the prefetch of the running unit, if it was prefetched.
        materialized: the modules whose offloaded weights are materialised now, by hook.
        worker: the background thread, started on the first prefetch.
        staging: the CUDA staging buffers, made on the first prefetch to a CUDA device.
    """

    def __init__(self, model: nn.Module, units: list[Unit]) -> None:
        self.model = weakref.ref(model)
        self.units = units
        self.unit_of_trigger = {unit.trigger: unit for unit in units}
        self.unit_of_member = {hook: unit for unit in units for _, hook in unit.members}
        self.handles: list[RemovableHandle] = []
        self._hook_plans: dict[AlignDevicesHook, Plan] = {}
        self._unit_plans: dict[Unit, Plan] = {}
        self.order: list[Unit] | None = None
        self.seen: list[Unit] = []
        self.forward_depth = 0
        self.synchronous_rest = False
        self.inflight: dict[int, _Prefetch] = {}
        self.current: _Prefetch | None = None
        self.materialized: dict[AlignDevicesHook, nn.Module] = {}
        self.worker: Worker | None = None
        self.staging: StagingPool | None = None
        self.paces: collections.deque[CopyEvent] = collections.deque()

    def sequence(self) -> list[Unit]:
        """The units in the order prefetching follows now."""
        return self.order if self.order is not None else self.units

    def learn(self, seen: list[Unit]) -> None:
        """Follow the order of a finished forward from the next one (unless it said nothing new)."""
        if not seen:
            return
        order = self.order
        if order is not None and (seen == order or seen == order[: len(seen)]):
            return  # same order, or the same start of it (a forward that ended early)
        if order is not None:
            logger.debug(
                "Offload prefetch: the blocks ran in a new order (%d units); following it from "
                "the next forward.",
                len(seen),
            )
        self.order = list(seen)

    def plan_of_hook(self, hook: AlignDevicesHook) -> Plan:
        """``hook``'s plan, worked out once."""
        plan = self._hook_plans.get(hook)
        if plan is None:
            plan = self._hook_plans[hook] = hook_plan(hook)
        return plan

    def plan_of_unit(self, unit: Unit) -> Plan:
        """``unit``'s plan, worked out once from its hooks' plans."""
        plan = self._unit_plans.get(unit)
        if plan is None:
            plans = [self.plan_of_hook(hook) for _, hook in unit.members]
            plan = self._unit_plans[unit] = combine_plans(plans)
        return plan

    def submit(self, job: Callable[[], StagedWeights]) -> concurrent.futures.Future[Any]:
        """Queue ``job`` on the background thread, starting one if there is none (or it died)."""
        worker = self.worker
        if worker is None or not worker.alive:
            worker = self.worker = Worker()
            # An engine dropped without close(): its thread exits once idle.
            weakref.finalize(self, worker.shutdown, wait=False)
        return worker.submit(job)

    def discard(self, record: _Prefetch) -> None:
        """Drop a prefetch: cancel it if queued, else wait for it so its memory goes now."""
        worker = self.worker
        if not record.future.cancel() and worker is not None and worker.alive:
            concurrent.futures.wait([record.future])
        record.result = None

    def drain(self) -> None:
        """Drop every prefetch, the running unit's included."""
        self.current = None
        self.paces.clear()
        pending = list(self.inflight.values())
        self.inflight.clear()
        for record in pending:
            self.discard(record)

    def staging_pool(self, api: CopyApi, mode: StagingMode, copy_threads: int) -> StagingPool:
        """The device staging of this binding, made on first use."""
        pool = self.staging
        if pool is None:
            largest = max((unit.nbytes for unit in self.units), default=0)
            pool = StagingPool(api, mode, copy_threads, largest)
            self.staging = pool
            # An engine dropped without close(): its copies are waited for and its page-locked
            # ranges released when the binding is collected.
            weakref.finalize(self, pool.close)
        return pool

    def forget_parent_thread(self) -> None:
        """In a forked child: the parent's thread, its queued work and its streams are not here."""
        self.worker = None
        self.inflight.clear()
        self.staging = None

    def close(self) -> None:
        """Drain, stop watching forwards, stop the thread, release the staging.

        Releasing the staging waits for its copies and unregisters its page-locked ranges.
        """
        self.drain()
        for handle in self.handles:
            handle.remove()
        self.handles = []
        worker = self.worker
        self.worker = None
        if worker is not None:
            worker.shutdown()
        pool = self.staging
        self.staging = None
        if pool is not None:
            pool.close()


class PrefetchingMaterializer:
    """Load offloaded weights ahead: the next ``prefetch_depth`` blocks while one runs.

    Install it with :func:`~accel_bigmodel.hooks.set_weight_materializer` (one instance per
    model; the dispatch functions do this for you). It learns the model's block order on each
    forward, pages the next blocks' file ranges in (and, for CUDA execution, copies them to the
    device on a side stream) from one background thread, and hands the weights to each module
    exactly as the synchronous path would, so outputs are bit-identical. See the package
    documentation for the order, the memory bound and the failure behaviour.

    Args:
        prefetch_depth: how many offloaded blocks to load ahead of the running one; ``0`` is
            Accelerate's synchronous behaviour.
        staging: how CPU weights reach a GPU: ``"auto"`` (page-lock resident weights in
            place, else a pinned ring), ``"register"`` (the same, warning on a refusal) or
            ``"ring"``; default ``ACCEL_OFFLOAD_STAGING``, else ``"auto"``.
        copy_threads: threads filling the pinned ring; default ``ACCEL_OFFLOAD_COPY_THREADS``,
            else ``min(4, CPUs)``.

    Raises:
        ValueError: ``prefetch_depth`` is not an int >= 0 (bools are refused too), or
            ``staging`` / ``copy_threads`` (or their environment variables) are invalid.

    Example::

        model = load_checkpoint_and_dispatch(model, "ckpt/", device_map=device_map)
        set_weight_materializer(model, PrefetchingMaterializer(prefetch_depth=2))
    """

    def __init__(
        self,
        prefetch_depth: int = DEFAULT_PREFETCH_DEPTH,
        *,
        staging: StagingMode | None = None,
        copy_threads: int | None = None,
    ) -> None:
        self.prefetch_depth = check_prefetch_depth(prefetch_depth)
        self.staging: StagingMode = resolve_staging_mode(staging)
        self.copy_threads = resolve_copy_threads(copy_threads)
        self._binding: _Binding | None = None
        self._warned = False
        self._rebind = False  # a copy of a bound engine: bind to the model its hooks are on

    def __repr__(self) -> str:
        return f"PrefetchingMaterializer(prefetch_depth={self.prefetch_depth})"

    # The device calls of the staging: one stateless object for every engine.
    _copy_api: CopyApi = CudaCopyApi()

    def staging_report(self) -> dict[str, Any]:
        """How the bound model's weights reached the GPU so far (empty before any staging).

        ``mode``, ``direct_bytes`` (copied straight from page-locked memory),
        ``ring_bytes`` (through the pinned ring), ``registered_bytes`` (page-locked now) and
        ``registration_refused`` (the driver's refusal, if there was one).
        """
        binding = self._binding
        pool = None if binding is None else binding.staging
        return {} if pool is None else pool.report()

    # A dispatched model may be deep-copied or pickled (an EMA or a reference model): the copy
    # gets a fresh engine with no thread, no buffers and nothing prefetched. The model's forward
    # hooks are copied with the model and point at the copy's engine, which binds itself to the
    # copied model when its first forward starts.
    def __deepcopy__(self, memo: dict[int, Any]) -> PrefetchingMaterializer:
        clone = PrefetchingMaterializer(
            self.prefetch_depth, staging=self.staging, copy_threads=self.copy_threads
        )
        clone._rebind = self._binding is not None or self._rebind
        memo[id(self)] = clone
        return clone

    def __getstate__(self) -> dict[str, Any]:
        return {
            "prefetch_depth": self.prefetch_depth,
            "staging": self.staging,
            "copy_threads": self.copy_threads,
            "rebind": self._binding is not None or self._rebind,
        }

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        self.prefetch_depth = check_prefetch_depth(state["prefetch_depth"])
        self.staging = resolve_staging_mode(state.get("staging"))
        self.copy_threads = resolve_copy_threads(state.get("copy_threads"))
        self._binding = None
        self._warned = False
        self._rebind = bool(state.get("rebind", False))

    # -- binding ----------------------------------------------------------------------------

    def bind(self, model: nn.Module) -> None:
        """Learn ``model``'s offloaded units and watch its forwards (called on installation).

        Raises:
            ValueError: this materialiser is bound to another model.
        """
        bound = self._binding.model() if self._binding is not None else None
        if bound is not None and bound is not model:
            raise ValueError(
                f"{self!r} is already bound to a {type(bound).__name__}, and a prefetching "
                "materialiser follows the blocks of one model: install a new one on this "
                f"{type(model).__name__}, e.g. set_weight_materializer(model, "
                f"PrefetchingMaterializer(prefetch_depth={self.prefetch_depth}))."
            )
        units = find_units(model)
        self.close()
        self._rebind = False
        binding = _Binding(model, units)
        binding.handles = [
            model.register_forward_pre_hook(self._forward_started, prepend=True),
            model.register_forward_hook(self._forward_finished, always_call=True),
        ]
        self._binding = binding

    def _bind_copy(self, model: nn.Module) -> None:
        """Bind a copied engine to the copied model, whose copied forward hooks call it.

        The copied hooks are replaced by ones this engine's binding owns (and removes on
        ``close``), so each forward still calls the engine once at each end.
        """
        for table in (model._forward_pre_hooks, model._forward_hooks):
            for key, function in list(table.items()):
                if getattr(function, "__self__", None) is self:
                    del table[key]
                    model._forward_hooks_always_called.pop(key, None)
        self.bind(model)

    def close(self) -> None:
        """Stop the background thread, drop everything prefetched and forget the model.

        Hooks that still point here afterwards load synchronously.
        """
        binding = self._binding
        self._binding = None
        if binding is not None:
            binding.close()

    # -- introspection ----------------------------------------------------------------------

    def block_order(self) -> list[str]:
        """The unit (block or module) names in the order prefetching follows now."""
        binding = self._binding
        return [] if binding is None else [unit.name for unit in binding.sequence()]

    def prefetched_blocks(self) -> list[str]:
        """The units whose weights the engine holds or is loading now, in order.

        That is the running unit (when it was prefetched) and those prefetched ahead of it: at
        most ``prefetch_depth + 1`` names.
        """
        binding = self._binding
        if binding is None:
            return []
        current, inflight = binding.current, binding.inflight
        names = [] if current is None else [current.unit.name]
        names.extend(inflight[position].unit.name for position in sorted(inflight))
        return names

    # -- WeightMaterializer -----------------------------------------------------------------

    def block_started(self, hook: AlignDevicesHook, module: nn.Module) -> None:
        """A device-map block starts: take its prefetch and start loading the next ones."""
        binding = self._binding
        unit = None if binding is None else binding.unit_of_trigger.get(hook)
        if binding is not None and unit is not None and unit.is_block:
            self._unit_started(binding, unit)

    def materialize(self, hook: AlignDevicesHook, module: nn.Module) -> None:
        """Set the offloaded tensors of ``module``, from its block's prefetch when there is one.

        Raises:
            FileNotFoundError: a file holding these weights was deleted (the message names it).
            ValueError: such a file is shorter than the weights need (truncated).
            KeyError: the weights map has no entry for one of the tensors.
        """
        binding = self._binding
        if binding is None:
            check_files(hook_plan(hook).files)
            materialize_weights(hook, module)
            return
        unit = binding.unit_of_member.get(hook)
        if unit is not None and not unit.is_block and unit.trigger is hook:
            self._unit_started(binding, unit)
        binding.materialized[hook] = module
        record = binding.current
        staged = None
        if record is not None and record.unit is unit:
            staged = self._result(record)
        if staged is None:
            check_files(binding.plan_of_hook(hook).files)
            materialize_weights(hook, module)
        else:
            materialize_weights(hook, module, staged.take(hook))

    def release(self, hook: AlignDevicesHook, module: nn.Module) -> None:
        """Put the offloaded tensors of ``module`` back on ``meta``."""
        if self._binding is not None:
            self._binding.materialized.pop(hook, None)
        release_weights(hook, module)

    # -- forwards ---------------------------------------------------------------------------

    def _forward_started(self, module: nn.Module, args: Any) -> None:
        binding = self._binding
        if binding is None and self._rebind:
            self._bind_copy(module)
            binding = self._binding
        if binding is None:
            return
        binding.forward_depth += 1
        if binding.forward_depth > 1:
            return
        if binding.worker is not None and not binding.worker.owned:
            binding.forget_parent_thread()
        binding.drain()
        binding.seen = []
        binding.synchronous_rest = False
        self._schedule(binding, 0, self.prefetch_depth - 1)

    def _forward_finished(self, module: nn.Module, args: Any, output: Any) -> None:
        binding = self._binding
        if binding is None or binding.forward_depth == 0:
            return
        binding.forward_depth -= 1
        if binding.forward_depth > 0:
            return
        binding.drain()
        # Modules whose forward raised never ran post_forward: put their weights back.
        leftovers = list(binding.materialized.items())
        binding.materialized.clear()
        for hook, owner in leftovers:
            release_weights(hook, owner)
        binding.learn(binding.seen)
        binding.seen = []

    def _unit_started(self, binding: _Binding, unit: Unit) -> None:
        if binding.forward_depth == 0:
            binding.current = None  # outside a forward of the model: synchronous
            return
        position = len(binding.seen)
        binding.seen.append(unit)
        record = binding.inflight.pop(position, None)
        for stale in [earlier for earlier in binding.inflight if earlier < position]:
            binding.discard(binding.inflight.pop(stale))
        binding.current = None
        if binding.synchronous_rest:
            if record is not None:
                binding.discard(record)
            return
        sequence = binding.sequence()
        expected = sequence[position] if position < len(sequence) else None
        if expected is not unit:
            if record is not None:
                binding.discard(record)
            if expected is not None:
                logger.debug(
                    "Offload prefetch: %r started where %r was expected; loading synchronously "
                    "until the end of this forward, then following the new order.",
                    unit.name,
                    expected.name,
                )
                binding.drain()
                binding.synchronous_rest = True
            return
        binding.current = record
        if binding.staging is not None:
            self._pace(binding, unit)
        self._schedule(binding, position + 1, position + self.prefetch_depth)

    def _pace(self, binding: _Binding, unit: Unit) -> None:
        """Keep the host at most two units ahead of the GPU before staging more.

        Copies are queued without waiting for the compute, and a unit's device tensors are
        freed for reuse only once the compute stream has passed them, so a host running far
        ahead of the GPU would hold many units in device memory. An event is recorded on the
        compute stream as each unit starts; the one from two units back is waited for, which
        bounds what is in flight to about ``prefetch_depth + 3`` units while still queuing
        each copy a unit ahead of its use.
        """
        device = unit.trigger.target_device
        if device is None or device.type != "cuda":
            return
        paces = binding.paces
        paces.append(self._copy_api.mark(cuda_device(device)))
        while len(paces) > PACE_UNITS:
            paces.popleft().synchronize()

    # -- prefetching ------------------------------------------------------------------------

    def _schedule(self, binding: _Binding, first: int, last: int) -> None:
        if self.prefetch_depth == 0:
            return
        sequence = binding.sequence()
        for position in range(max(first, 0), min(last, len(sequence) - 1) + 1):
            if position in binding.inflight:
                continue
            unit = sequence[position]
            job = self._job(binding, unit)
            if job is not None:
                binding.inflight[position] = _Prefetch(unit, binding.submit(job))

    def _job(self, binding: _Binding, unit: Unit) -> Callable[[], StagedWeights] | None:
        try:
            plan = binding.plan_of_unit(unit)
        except (OSError, ValueError, KeyError):
            return None  # the synchronous path reports it when the unit runs
        staging: _Staging = ()
        on_cuda = [
            (hook, hook.target_device)
            for _, hook in unit.members
            if hook.target_device is not None and hook.target_device.type == "cuda"
        ]
        if on_cuda and torch.cuda.is_available():
            # Device indexes are resolved here: the current device is per thread.
            staging = tuple((hook, cuda_device(device)) for hook, device in on_cuda)
        if plan.empty and not staging:
            return None
        pool = (
            binding.staging_pool(self._copy_api, self.staging, self.copy_threads)
            if staging
            else None
        )
        return functools.partial(_load_unit, unit, plan, staging, pool)

    def _result(self, record: _Prefetch) -> StagedWeights | None:
        if record.result is None and not record.failed:
            try:
                record.result = record.future.result()
            except Exception as error:  # noqa: BLE001 - the synchronous path takes over
                record.failed = True
                file_problem = isinstance(error, (OSError, ValueError))
                if not file_problem and not self._warned:
                    self._warned = True
                    logger.warning(
                        "Offload prefetch of %r failed (%s: %s); loading synchronously.",
                        record.unit.name,
                        type(error).__name__,
                        error,
                    )
                else:
                    logger.debug("Offload prefetch of %r failed: %s", record.unit.name, error)
        return record.result


def _load_unit(
    unit: Unit, plan: Plan, staging: _Staging, pool: StagingPool | None
) -> StagedWeights:
    """Runs on the background thread: check the files, page in, stage to the device."""
    check_files(plan.files)
    PAGER.page_in(plan.ranges, plan.populated)
    plan.populated = True
    if not staging or pool is None:
        return StagedWeights()
    by_device: dict[torch.device, list[StagedItem]] = {}
    with torch.no_grad():
        for hook, device in staging:
            items = _host_weights(hook, unit.dtypes.get(hook, {}))
            if items:
                by_device.setdefault(device, []).extend(items)
    return pool.stage(by_device)


def _host_weights(hook: AlignDevicesHook, dtypes: Mapping[str, torch.dtype]) -> list[StagedItem]:
    """``hook``'s offloaded host weights to stage, as stored (cast on the device if needed).

    A weight is resident (it may be page-locked in place) when its weights map places it in
    memory rather than in a file (``weight_location`` is ``None``). Tied weights are left out:
    they share one device copy, made by the synchronous path.
    """
    weights = hook.weights_map
    if weights is None:
        return []
    tied = hook.tied_params_map
    locate = getattr(weights, "weight_location", None)
    items: list[StagedItem] = []
    for name in hook.offloaded_names:
        try:
            host = weights[name]
            resident = locate is None or locate(name) is None
        except (KeyError, OSError):
            continue
        if not stageable(host):
            continue
        if tied is not None and (name in hook.tied_params_names or host.data_ptr() in tied):
            continue
        wanted = dtypes.get(name, host.dtype)
        if not castable(host.dtype) or not castable(wanted):
            wanted = host.dtype
        items.append(StagedItem(hook, name, host, wanted, resident))
    return items


def install_prefetch(model: nn.Module, prefetch_depth: int, caller: str) -> None:
    """Install a :class:`PrefetchingMaterializer` on a freshly hooked model, if it offloads.

    Args:
        model: the hooked model.
        prefetch_depth: the resolved depth (see ``resolve_prefetch_depth``).
        caller: the public function installing it, for the debug log.
    """
    if not has_offloaded_weights(model):
        logger.debug(
            "%s(prefetch_depth=%d): no block of this model is offloaded, so there is nothing "
            "to prefetch.",
            caller,
            prefetch_depth,
        )
        return
    set_weight_materializer(model, PrefetchingMaterializer(prefetch_depth))
