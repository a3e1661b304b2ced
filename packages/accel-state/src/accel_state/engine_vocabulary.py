"""The words engine settings are written in: one list of choices for every reader.

``accel launch`` checks its ``--fsdp_*`` / ``--offload_*`` flags against these, the FSDP2
plugin (accel) checks its arguments and ``FSDP_*`` variables against them, ``accel config``
offers them as choices and ``accel to-fsdp2`` converts FSDP1 files with them; they live in the
lowest package so that all of them read the same list.
"""

from __future__ import annotations

from types import MappingProxyType

__all__ = [
    "FSDP2_STATE_DICT_TYPES",
    "FSDP_AUTO_WRAP_POLICIES",
    "FSDP_BACKWARD_PREFETCHES",
    "FSDP_SHARDING_STRATEGIES",
    "FSDP_STATE_DICT_TYPES",
    "OFFLOAD_DEVICES",
    "RESHARD_OF_STRATEGY",
]

#: Where DeepSpeed can offload optimizer states and parameters.
OFFLOAD_DEVICES: tuple[str, ...] = ("none", "cpu", "nvme")
#: FSDP1 sharding strategies (also accepted by ``fsdp_reshard_after_forward`` under FSDP1).
FSDP_SHARDING_STRATEGIES: tuple[str, ...] = (
    "FULL_SHARD",
    "SHARD_GRAD_OP",
    "NO_SHARD",
    "HYBRID_SHARD",
    "HYBRID_SHARD_ZERO2",
)
#: The wrap policies by name (``--fsdp_auto_wrap_policy``, ``FSDP_AUTO_WRAP_POLICY``).
FSDP_AUTO_WRAP_POLICIES: tuple[str, ...] = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
#: FSDP1 backward prefetch modes (FSDP2 prefetches by itself).
FSDP_BACKWARD_PREFETCHES: tuple[str, ...] = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
#: The state dict types FSDP1 knew.
FSDP_STATE_DICT_TYPES: tuple[str, ...] = (
    "FULL_STATE_DICT",
    "LOCAL_STATE_DICT",
    "SHARDED_STATE_DICT",
)
#: The state dict types FSDP2 saves (no ``LOCAL_STATE_DICT``).
FSDP2_STATE_DICT_TYPES: tuple[str, ...] = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
#: FSDP2's ``reshard_after_forward`` for each FSDP1 sharding strategy that shards
#: (``_HYBRID_SHARD_ZERO2`` is torch's own spelling); ``NO_SHARD`` has no FSDP2 equivalent.
RESHARD_OF_STRATEGY: MappingProxyType[str, bool] = MappingProxyType(
    {
        "FULL_SHARD": True,
        "HYBRID_SHARD": True,
        "SHARD_GRAD_OP": False,
        "HYBRID_SHARD_ZERO2": False,
        "_HYBRID_SHARD_ZERO2": False,
    }
)
