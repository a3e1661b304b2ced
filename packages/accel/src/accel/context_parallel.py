"""Context parallelism: each rank of the ``cp`` group attends over a slice of the sequence.

``ParallelismConfig(cp_size=N)`` with FSDP2 (which averages gradients over ``dp_shard_cp``)
splits every sequence N ways. Inside ``with accelerator.maybe_context_parallel(buffers=...,
buffer_seq_dims=..., no_restore_buffers=...)`` the given tensors are cut along their sequence
dimension in place (torch's load-balanced split, so causal work is even) and
``scaled_dot_product_attention`` runs as ring attention over the group; on leaving, the
buffers not in ``no_restore_buffers`` get their whole contents back.

torch's implementation replaces SDPA's flash, memory-efficient and cuDNN kernels, which only
CUDA (and ROCm) devices have: on any other device ``cp_size > 1`` is refused when the
Accelerator is built (:func:`accel.parallelism.check_context_parallel_device`), never run as a
no-op. Ring attention takes no attention mask: the models' attention modules get a hook that
drops a causal mask and asks SDPA for ``is_causal=True`` instead, and models with a stricter
mask (sliding-window or chunked layers) are refused at ``prepare``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["context_parallel_region", "prepare_context_parallel"]

logger = logging.getLogger("accel.context_parallel")

_warned_disabled = False


def _stricter_than_causal(model: torch.nn.Module) -> set[str]:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return {kind for kind in layer_types if kind != "full_attention"}
    return {"sliding_attention"} if getattr(config, "sliding_window", None) else set()


def _causal_instead_of_mask(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if kwargs.get("attention_mask") is not None:
        kwargs = {**kwargs, "attention_mask": None, "is_causal": True}
    return args, kwargs


def prepare_context_parallel(model: torch.nn.Module, config: Any) -> None:
    """Set the ring's exchange (``cp_comm_strategy``) and hook ``model``'s attention modules.

    Raises:
        ValueError: the model has attention layers stricter than full causal attention.
    """
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    stricter = _stricter_than_causal(model)
    if stricter:
        raise ValueError(
            f"context parallelism cannot train {type(model).__name__}: its attention layers of "
            f"type {sorted(stricter)} use a mask stricter than causal, and ring attention only "
            "expresses full causal attention (their mask would be dropped). Use a model with "
            "full attention only, or set cp_size=1"
        )
    handler = getattr(config, "cp_handler", None)
    set_rotate_method(getattr(handler, "cp_comm_strategy", None) or "allgather")
    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            module.register_forward_pre_hook(_causal_instead_of_mask, with_kwargs=True)


@contextlib.contextmanager
def context_parallel_region(
    state: Any,
    buffers: list[torch.Tensor] | None = None,
    buffer_seq_dims: list[int] | None = None,
    no_restore_buffers: set[torch.Tensor] | None = None,
) -> Iterator[None]:
    """Split ``buffers`` along their sequence dimension over ``cp`` inside the block.

    A no-op (logged once) when the run has no context parallelism, as in Accelerate.

    Raises:
        ValueError: ``buffers`` and ``buffer_seq_dims`` differ in length.
    """
    global _warned_disabled
    config = getattr(state, "parallelism_config", None)
    mesh = getattr(state, "device_mesh", None)
    if config is None or not config.cp_enabled or mesh is None:
        if not _warned_disabled:
            _warned_disabled = True
            logger.warning(
                "maybe_context_parallel: context parallelism is not enabled, so the block runs "
                "unchanged; set ParallelismConfig(cp_size=...) above 1 to split sequences"
            )
        yield
        return
    buffers = list(buffers or [])
    dims = list(buffer_seq_dims or [])
    if len(buffers) != len(dims):
        raise ValueError(
            f"maybe_context_parallel: {len(buffers)} buffers but {len(dims)} buffer_seq_dims; "
            "give one sequence dimension per buffer"
        )
    from torch.distributed.tensor.experimental import context_parallel

    with context_parallel(
        mesh["cp"],
        buffers=buffers,
        buffer_seq_dims=dims,
        no_restore_buffers=set(no_restore_buffers or ()),
    ):
        yield
