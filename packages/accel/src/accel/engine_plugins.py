"""The engine plugins of Accelerate 1.15, with its fields and defaults.

``FullyShardedDataParallelPlugin`` drives the FSDP2 engine and ``DeepSpeedPlugin`` the
DeepSpeed one (each is defined with its engine, in :mod:`accel.engines`, and re-exported
here); ``DummyOptim`` / ``DummyScheduler`` stand for an optimizer / scheduler defined in the
DeepSpeed config. ``MegatronLMPlugin`` and ``TorchTensorParallelPlugin`` can be imported and
built exactly as with Accelerate, so a migrated script, a config helper or a test that
constructs one keeps working. ``Accelerator(torch_tp_plugin=...)`` trains: it is the old
spelling of ``ParallelismConfig(tp_size=...)``, turned into one with a ``FutureWarning``
(:func:`accel.parallelism.resolve_parallelism`) and trained by the tensor-parallel engine.
Megatron-LM has no engine in this release: passing ``megatron_lm_plugin`` (or asking for it
through ``accel launch --use_megatron_lm`` or ``ACCEL_USE_MEGATRON_LM``) is refused before any
process trains, with a message that says so (:mod:`accel_state.engine_requests`).

``ParallelismConfig`` and its handlers live in :mod:`accel.parallelism_config`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .engines.deepspeed_plugin import DeepSpeedPlugin
from .engines.fsdp_plugin import FullyShardedDataParallelPlugin

__all__ = [
    "DeepSpeedPlugin",
    "DummyOptim",
    "DummyScheduler",
    "FullyShardedDataParallelPlugin",
    "MegatronLMPlugin",
    "TorchTensorParallelPlugin",
]


class DummyOptim:
    """Stands for an optimizer defined in a DeepSpeed config (Accelerate's signature).

    Pass it to ``prepare`` with the model under DeepSpeed: the config's ``optimizer`` section
    is then built by DeepSpeed over ``params``, its ``"auto"`` lr and weight decay taken from
    here.
    """

    def __init__(self, params: Any, lr: float = 0.001, weight_decay: float = 0, **kwargs: Any):
        self.params = params
        self.lr = lr
        self.weight_decay = weight_decay
        self.kwargs = kwargs


class DummyScheduler:
    """Stands for a scheduler defined in a DeepSpeed config (Accelerate's signature).

    Pass it to ``prepare`` under DeepSpeed: the config's ``scheduler`` section is then built
    and stepped by DeepSpeed, its ``"auto"`` step counts taken from here.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int | None = None,
        warmup_num_steps: int = 0,
        lr_scheduler_callable: Callable[..., Any] | None = None,
        **kwargs: Any,
    ):
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs


@dataclasses.dataclass
class TorchTensorParallelPlugin:
    """Accelerate's older tensor-parallel plugin (it stands for ``ParallelismConfig(tp_size=)``).

    ``Accelerator(torch_tp_plugin=TorchTensorParallelPlugin(tp_size=n))`` trains as
    ``ParallelismConfig(tp_size=n)`` and warns that the plugin is deprecated (as in Accelerate).
    """

    tp_size: int = 1
    torch_device_mesh: Any = None


@dataclasses.dataclass
class MegatronLMPlugin:
    """Megatron-LM settings with Accelerate 1.15's fields and defaults.

    Building one works; ``Accelerator(megatron_lm_plugin=...)`` is refused: accel deliberately
    does not build Megatron-LM's own training loop; FSDP2 with tensor parallelism
    (``ParallelismConfig(dp_shard_size=..., tp_size=...)``) trains models too big for one
    device.
    """

    tp_degree: int | None = None
    pp_degree: int | None = None
    use_custom_fsdp: bool | None = None
    overlap_cpu_optimizer_d2h_h2d: bool | None = None
    no_load_optim: bool | None = None
    eod_mask_loss: bool | None = None
    no_save_optim: bool | None = None
    optimizer_cpu_offload: bool | None = None
    use_precision_aware_optimizer: bool | None = None
    decoder_last_pipeline_num_layers: int | None = None
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    attention_backend: bool | None = None
    expert_model_parallel_size: int | None = None
    context_parallel_size: int | None = None
    attention_dropout: float | None = None
    hidden_dropout: float | None = None
    attention_softmax_in_fp32: bool | None = None
    expert_tensor_parallel_size: int | None = None
    calculate_per_token_loss: bool | None = None
    use_rotary_position_embeddings: bool | None = None
    num_micro_batches: int | None = None
    gradient_clipping: float | None = None
    sequence_parallelism: bool | None = None
    recompute_activations: bool | None = None
    use_distributed_optimizer: bool | None = None
    pipeline_model_parallel_split_rank: int | None = None
    num_layers_per_virtual_pipeline_stage: int | None = None
    is_train_batch_min: bool = True
    train_iters: int | None = None
    train_samples: int | None = None
    weight_decay_incr_style: str = "constant"
    start_weight_decay: float | None = None
    end_weight_decay: float | None = None
    lr_decay_style: str = "linear"
    lr_decay_iters: int | None = None
    lr_decay_samples: int | None = None
    lr_warmup_iters: int | None = None
    lr_warmup_samples: int | None = None
    lr_warmup_fraction: float | None = None
    min_lr: float = 0
    consumed_samples: list[int] | None = None
    no_wd_decay_cond: Callable[..., Any] | None = None
    scale_lr_cond: Callable[..., Any] | None = None
    lr_mult: float = 1.0
    megatron_dataset_flag: bool = False
    seq_length: int | None = None
    encoder_seq_length: int | None = None
    decoder_seq_length: int | None = None
    tensorboard_dir: str | None = None
    set_all_logging_options: bool = False
    eval_iters: int = 100
    eval_interval: int = 1000
    return_logits: bool = False
    custom_train_step_class: Any = None
    custom_train_step_kwargs: dict[str, Any] | None = None
    custom_model_provider_function: Callable[..., Any] | None = None
    custom_prepare_model_function: Callable[..., Any] | None = None
    custom_megatron_datasets_provider_function: Callable[..., Any] | None = None
    custom_get_batch_function: Callable[..., Any] | None = None
    custom_loss_function: Callable[..., Any] | None = None
    other_megatron_args: dict[str, Any] | None = None
