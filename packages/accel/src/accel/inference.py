"""Accelerate's ``accelerate.inference``: pipeline-parallel inference, not in accel.

``prepare_pippy`` splits a model into pipeline stages over processes. accel has no pipeline
engine in this release, so the name imports and calling it raises ``NotImplementedError``;
models too big for one device run with ``accel.big_modeling`` (``device_map="auto"``).
"""

from __future__ import annotations

from .unavailable import unavailable_function

__all__ = ["prepare_pippy"]

prepare_pippy = unavailable_function(
    "prepare_pippy",
    "pipeline-parallel inference, which is not in this release of accel",
    "To run a model larger than one device, use load_checkpoint_and_dispatch or "
    "dispatch_model with device_map='auto'.",
)
