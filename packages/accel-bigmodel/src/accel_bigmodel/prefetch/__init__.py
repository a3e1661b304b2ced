"""The offload engine: bring the next offloaded blocks in while the current one runs.

:class:`PrefetchingMaterializer` is a :class:`~accel_bigmodel.hooks.WeightMaterializer` that
overlaps loading offloaded weights with compute. ``dispatch_model``, ``cpu_offload``,
``disk_offload`` and ``load_checkpoint_and_dispatch`` install one (``prefetch_depth``, default
1 or ``ACCEL_OFFLOAD_PREFETCH_DEPTH``) whenever the model has offloaded weights.

Units and order
---------------
The unit of prefetching is a device-map block with offloaded weights (the block hooks of
:func:`~accel_bigmodel.hooks.attach_align_device_hook_on_blocks`); in a model hooked by
``cpu_offload`` / ``disk_offload``, which has no blocks, every offloading hook is its own unit.
When unit k starts, units k+1 .. k+``prefetch_depth`` are handed to one background thread. The
order is the model's real call order, recorded on each forward (forward boundaries come from a
pre-hook and an ``always_call`` forward hook on the model); before the first forward it is the
device map's order. When a unit starts that the order did not predict, everything prefetched is
dropped, the rest of that forward loads synchronously, and the order seen in that forward
replaces the learned one. ``prefetch_depth=0`` loads every unit when it starts, as Accelerate's
hooks do. Units run outside a forward of the model (e.g. a submodule called directly, or
``align_module_device``) load synchronously.

What a prefetch does
--------------------
- Always: checks that each file holding the unit's weights still exists and is long enough
  (one ``stat`` per file), so that a file deleted or truncated under a running model raises an
  error naming it instead of a ``SIGBUS``; then pages the unit's byte ranges in: ``madvise``
  ``MADV_WILLNEED`` (read-ahead) and ``MADV_POPULATE_READ`` (Linux >= 5.14; reads the pages and
  maps them into the very memory maps the weight views use, so the block's compute takes no
  page faults; it fails with ``EFAULT`` instead of raising ``SIGBUS``). The GIL is released
  during these calls. On CPU execution the block then runs on the same zero-copy views as the
  synchronous path: outputs are bit-identical.
- Execution on a CUDA device, additionally: the thread copies the unit's weights to new
  device tensors on a side stream (:mod:`.cuda_staging`) and records an event after them;
  ``materialize`` makes the current stream wait for that event and calls ``record_stream`` on
  the tensors it uses. Weights kept in RAM (the ``"cpu"`` blocks: zero-copy views of the
  user's safetensors files, or tensors in memory) are page-locked where they are the first
  time (``cuMemHostRegister``, read-only: no copy of a page, no anonymous memory) and every
  later copy is one DMA from them, with no CPU work; disk weights, and resident ones the driver
  would not page-lock, go through a ring of pinned slots filled by ``copy_threads`` threads
  while the previous slots are copied (``ACCEL_OFFLOAD_STAGING`` chooses: ``auto``,
  ``register``, ``ring``). Weights travel as stored and are cast on the device when the model
  wants another dtype. Tied weights are left to the synchronous path (their one shared device
  copy).

Memory bound
------------
At most ``prefetch_depth + 1`` units are held at any time: the running one and the ones
prefetched ahead (the rest are dropped when a unit starts; a prefetched-but-unused unit is
dropped on a mismatch, at the end of a forward, or when a forward raises). On CPU execution
the weights are views of the files' memory maps (page cache, not anonymous memory), so the
engine adds no anonymous memory. On a CUDA device: device memory <= ``(prefetch_depth + 1)``
x the largest offloaded unit, plus a pinned ring of 4 slots of ``min(32 MiB, the largest
unit)`` per device, allocated on first use; the page-locked CPU weights are the CPU tier itself
(locked in place, released when the engine closes).

When a forward raises, the pipeline drains (queued prefetches are cancelled, a running one is
awaited, everything prefetched is dropped) and any weights the failed modules left
materialised are put back on ``meta``, so the next forward starts clean.

Modules
-------
``depth`` (the ``prefetch_depth`` default and checks), ``paging`` (file checks and
``madvise``, no model knowledge), ``plan`` (units and the bytes each reads), ``worker`` (the
thread), ``staging_mode`` (the staging settings), ``copy_api`` (the device calls, faked in
tests), ``host_pinning`` (page-locking in place), ``copy_threads`` (GIL-free parallel memcpy),
``cuda_staging`` (the side-stream copies) and ``engine`` (:class:`PrefetchingMaterializer`,
which ties them together).
"""

from __future__ import annotations

# resolve_prefetch_depth, install_prefetch and page_in_background are shared with the rest of
# accel_bigmodel (dispatch.py, whole_model.py, pretrained.py), not public API.
from .depth import DEFAULT_PREFETCH_DEPTH, PREFETCH_DEPTH_ENV
from .depth import resolve_prefetch_depth as resolve_prefetch_depth
from .engine import PrefetchingMaterializer
from .engine import install_prefetch as install_prefetch
from .paging import page_in_background as page_in_background

__all__ = ["DEFAULT_PREFETCH_DEPTH", "PREFETCH_DEPTH_ENV", "PrefetchingMaterializer"]
