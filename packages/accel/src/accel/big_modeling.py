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

# Accelerate keeps its sequence-parallelism model check here, under this private name; its
# tests import it from here.
from .parallelism_config import (
    refuse_recurrent_layers_under_sequence_parallelism as _refuse_recurrent_layers_under_sequence_parallelism,  # noqa: E501, F401
)

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
