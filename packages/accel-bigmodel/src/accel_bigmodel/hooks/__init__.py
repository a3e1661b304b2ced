"""Module hooks: code that runs around a module's ``forward`` and moves weights where it runs.

The package holds the hook protocol (:class:`ModelHook`, :func:`add_hook_to_module`,
:func:`remove_hook_from_module`; :mod:`.protocol`), the weight materialisation interface
(:class:`WeightMaterializer`; :mod:`.materialize`), the hook that aligns a module's weights and
inputs with its execution device (:class:`AlignDevicesHook`; :mod:`.align`), the functions that
attach it over a model, per module or per device-map block (:mod:`.attach`), and the
whole-model CPU offload hook (:class:`CpuOffload`; :mod:`.cpu_offload`).

How offloaded weights reach the execution device
------------------------------------------------
An offloading :class:`AlignDevicesHook` keeps its module's tensors on the ``meta`` device between
calls. Its ``pre_forward`` asks ``hook.materializer.materialize(hook, module)`` to put every
tensor named in ``hook.offloaded_names`` on ``hook.target_device`` (reading ``hook.weights_map``),
and its ``post_forward`` calls ``hook.materializer.release(hook, module)`` to drop them again.
The default, :data:`SYNCHRONOUS_MATERIALIZER`, reads each tensor when the module starts; on CPU
execution a weight that the weights map returns as a CPU tensor of the right dtype (for example a
view of a memory-mapped safetensors file) becomes the parameter as it is, without a copy.

:func:`attach_align_device_hook_on_blocks` makes one hook per device-map entry that block's
*block hook*: it gets a :class:`~.align.BlockLink` (``hook.block``), from which it reads
``hook.block_name``, ``hook.block_index``, the hook of the block that runs next
(``hook.next_block_hook``) and the offloading hooks inside its block
(``hook.block_offload_hooks``). A block hook calls ``materializer.block_started(hook, module)``
when its block starts, before anything of the block is materialised, so a prefetching
materialiser (installed with :func:`set_weight_materializer`) can start loading block k+1 while
block k runs. :func:`get_block_hooks` lists a model's block hooks in order. The offload engine,
:class:`~accel_bigmodel.prefetch.PrefetchingMaterializer`, is that materialiser; the dispatch
functions install it.
"""

from __future__ import annotations

# Imported `as` themselves: shared inside accel_bigmodel (dispatch, prefetch), not in __all__.
from .align import (
    AlignDevicesHook,
    TiedParamsMap,
    align_module_device,
    find_align_devices_hook,
    get_block_hooks,
    has_offloaded_params,
    set_weight_materializer,
)
from .align import align_hooks as align_hooks
from .attach import (
    attach_align_device_hook,
    attach_align_device_hook_on_blocks,
    attach_execution_device_hook,
)
from .cpu_offload import CpuOffload, UserCpuOffloadHook
from .materialize import (
    SYNCHRONOUS_MATERIALIZER,
    SynchronousMaterializer,
    WeightMaterializer,
)
from .materialize import materialize_weights as materialize_weights
from .materialize import release_weights as release_weights
from .protocol import GUARDED_METHODS as GUARDED_METHODS
from .protocol import (
    ModelHook,
    SequentialHook,
    add_hook_to_module,
    remove_hook_from_module,
    remove_hook_from_submodules,
)
from .protocol import hook_of as hook_of

__all__ = [
    "SYNCHRONOUS_MATERIALIZER",
    "AlignDevicesHook",
    "CpuOffload",
    "ModelHook",
    "SequentialHook",
    "SynchronousMaterializer",
    "TiedParamsMap",
    "UserCpuOffloadHook",
    "WeightMaterializer",
    "add_hook_to_module",
    "align_module_device",
    "attach_align_device_hook",
    "attach_align_device_hook_on_blocks",
    "attach_execution_device_hook",
    "find_align_devices_hook",
    "get_block_hooks",
    "has_offloaded_params",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
    "set_weight_materializer",
]
