"""``DataLoaderConfiguration``: how ``Accelerator.prepare`` shards data loaders."""

from __future__ import annotations

import dataclasses

__all__ = ["DataLoaderConfiguration"]


@dataclasses.dataclass
class DataLoaderConfiguration:
    """Settings for preparing data loaders (the fields and defaults of Accelerate's).

    Args:
        split_batches: Each batch of the original loader is split between the processes
            (its size must be a multiple of the number of processes) instead of every
            process drawing a batch of that size.
        dispatch_batches: Rank 0 reads every batch and sends each process its share.
            ``None`` means: for iterable datasets only.
        even_batches: Complete the last round with samples from the start, so every process
            gets the same number of full batches.
        use_seedable_sampler: Replace a ``RandomSampler`` with a
            :class:`~accel_data.SeedableRandomSampler`, whose order depends only on the seed
            and the epoch (the same for any number of processes).
        data_seed: Seed of the seedable sampler (``None``: drawn from torch's generator).
        non_blocking: Copy batches to the device asynchronously (with ``pin_memory``).
        use_stateful_dataloader: Accepted for compatibility. Every prepared loader already
            has ``state_dict()`` / ``load_state_dict()`` with exact mid-epoch resume, so
            torchdata's ``StatefulDataLoader`` is not needed.
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False
