"""Accelerate's ``accelerate.utils.offload``, re-exported from the packages that own it.

Offloaded weights on disk (Accelerate's ``accelerate.utils.offload``).
"""

from __future__ import annotations

from accel_bigmodel import (
    OffloadedWeightsLoader,
    PrefixedDataset,
    extract_submodules_state_dict,
    load_offloaded_weight,
    offload_state_dict,
    offload_weight,
    save_offload_index,
)

__all__ = [
    "OffloadedWeightsLoader",
    "PrefixedDataset",
    "extract_submodules_state_dict",
    "load_offloaded_weight",
    "offload_state_dict",
    "offload_weight",
    "save_offload_index",
]
