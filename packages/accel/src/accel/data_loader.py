"""Accelerate's ``accelerate.data_loader`` names, re-exported from accel-data.

Re-export module only: sharded samplers and loaders, rank-0 dispatch, ``prepare_data_loader``
and ``skip_first_batches`` are implemented in :mod:`accel_data`; this module gives them their
Accelerate import path.
"""

from __future__ import annotations

from accel_data import (
    BatchSamplerShard,
    DataLoaderDispatcher,
    DataLoaderShard,
    DataLoaderStateMixin,
    IterableDatasetShard,
    SeedableRandomSampler,
    SkipBatchSampler,
    SkipDataLoader,
    get_sampler,
    prepare_data_loader,
    skip_first_batches,
)

__all__ = [
    "BatchSamplerShard",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "DataLoaderStateMixin",
    "IterableDatasetShard",
    "SeedableRandomSampler",
    "SkipBatchSampler",
    "SkipDataLoader",
    "get_sampler",
    "prepare_data_loader",
    "skip_first_batches",
]
