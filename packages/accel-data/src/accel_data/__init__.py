"""accel-data: sharded data loading for PyTorch, usable inside any training framework.

Per-process samplers and loaders (``BatchSamplerShard``, ``IterableDatasetShard``,
``DataLoaderShard``), rank-0 dispatch (``DataLoaderDispatcher``), ``prepare_data_loader``,
``skip_first_batches``, and exact mid-epoch resume through ``state_dict()`` /
``load_state_dict()`` on every prepared loader. Depends only on torch and accel-state.
"""

from __future__ import annotations

from .__about__ import __version__
from .config import DataLoaderConfiguration
from .dispatch import DataLoaderDispatcher
from .iterable import IterableDatasetShard
from .loaders import DataLoaderShard, DataLoaderStateMixin, SkipDataLoader
from .prepare import prepare_data_loader, skip_first_batches
from .resume import get_sampler
from .samplers import BatchSamplerShard, SeedableRandomSampler, SkipBatchSampler

__all__ = [
    "BatchSamplerShard",
    "DataLoaderConfiguration",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "DataLoaderStateMixin",
    "IterableDatasetShard",
    "SeedableRandomSampler",
    "SkipBatchSampler",
    "SkipDataLoader",
    "__version__",
    "get_sampler",
    "prepare_data_loader",
    "skip_first_batches",
]
