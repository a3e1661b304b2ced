"""Accelerate's ``accelerate.big_modeling``: meta-device init, dispatch and offload."""

from __future__ import annotations

from accel_bigmodel import (
    SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING,
    attach_layerwise_casting_hooks,
    cpu_offload,
    cpu_offload_with_hook,
    disk_offload,
    dispatch_model,
    init_empty_weights,
    init_on_device,
    load_checkpoint_and_dispatch,
    load_pretrained,
)

# Accelerate keeps its sequence-parallelism model check here; its tests import it from here.

__all__ = [
    "SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING",
    "attach_layerwise_casting_hooks",
    "cpu_offload",
    "cpu_offload_with_hook",
    "disk_offload",
    "dispatch_model",
    "init_empty_weights",
    "init_on_device",
    "load_checkpoint_and_dispatch",
    "load_pretrained",
]
