"""Accelerate names whose feature accel does not have: importable, and refusing when used.

A script or a library written for Accelerate may import names such as
``accelerate.utils.fsdp_utils.save_fsdp_model`` or ``accelerate.utils.DeepSpeedEngineWrapper``
at its top even when it never calls them. Those imports work with accel too. Calling such a
function, or building such a class, raises ``NotImplementedError`` naming the feature, why it
is missing and what to use instead; nothing is faked. ``docs/compat.md`` lists them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

__all__ = ["unavailable_class", "unavailable_function"]

_FSDP = (
    "Accelerate's FSDP internals; accel's FSDP2 engine does this step inside "
    "Accelerator.prepare / save_state / load_state"
)
_DEEPSPEED = (
    "Accelerate's DeepSpeed internals; accel's DeepSpeed engine does this step inside "
    "Accelerator.prepare"
)
_MEGATRON = "Megatron-LM, which accel does not implement"
_TE = "NVIDIA Transformer Engine FP8, which accel does not drive (FP8 comes from torchao)"
_XLA = "installing torch_xla from a notebook, which accel does not do (it never installs packages)"


def _message(name: str, feature: str, instead: str) -> str:
    return f"{name} needs {feature}. {instead}".rstrip()


def unavailable_function(name: str, feature: str, instead: str = "") -> Callable[..., NoReturn]:
    """A function named ``name`` that raises ``NotImplementedError`` when called.

    Args:
        name: The Accelerate name it stands for.
        feature: What it needs that accel lacks, as ``"<name> needs <feature>."`` reads.
        instead: What to do instead (a sentence), if anything.
    """
    message = _message(name, feature, instead)

    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(message)

    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = f"Not available in accel: {message}"
    return refuse


def unavailable_class(name: str, feature: str, instead: str = "") -> type:
    """A class named ``name`` whose construction raises ``NotImplementedError``."""
    message = _message(name, feature, instead)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(message)

    return type(name, (), {"__init__": __init__, "__doc__": f"Not available in accel: {message}"})


def _functions(feature: str, instead: str, *names: str) -> dict[str, Callable[..., NoReturn]]:
    return {name: unavailable_function(name, feature, instead) for name in names}


#: ``accelerate.utils.fsdp_utils``.
FSDP_UTILS = _functions(
    _FSDP,
    "Pass a FullyShardedDataParallelPlugin to the Accelerator and call those methods.",
    "ensure_weights_retied",
    "fsdp2_apply_ac",
    "fsdp2_load_full_state_dict",
    "fsdp2_prepare_auto_wrap_policy",
    "fsdp2_prepare_model",
    "fsdp2_switch_optimizer_parameters",
)

#: ``accelerate.utils.deepspeed``'s internals (the engine, its wrappers, plugins and
#: ``map_pytorch_optim_to_deepspeed`` are real).
DEEPSPEED = {
    name: unavailable_class(name, _DEEPSPEED, "Use deepspeed.zero.GatheredParameters itself.")
    for name in ("GatheredParameters",)
}

#: ``accelerate.utils.megatron_lm`` and the Megatron config parsers of ``utils.dataclasses``.
MEGATRON_LM = {
    **_functions(
        _MEGATRON,
        "",
        "avg_losses_across_data_parallel_group",
        "finish_mpu_init",
        "gather_across_data_parallel_groups",
        "initialize",
        "model_provider_func",
        "prepare_data_loader",
        "prepare_model_optimizer_scheduler",
        "prepare_optimizer",
        "prepare_scheduler",
        "add_model_config_to_megatron_parser",
        "parse_bert_config",
        "parse_glm4_moe_config",
        "parse_gpt2_config",
        "parse_llama_config",
        "parse_t5_config",
    ),
    **{
        name: unavailable_class(name, _MEGATRON)
        for name in (
            "AbstractTrainStep",
            "BertTrainStep",
            "GPTTrainStep",
            "T5TrainStep",
            "MegatronEngine",
            "MegatronLMDummyDataLoader",
            "MegatronLMDummyScheduler",
            "MegatronLMOptimizerWrapper",
            "MegatronLMSchedulerWrapper",
        )
    },
}

#: ``accelerate.utils.transformer_engine`` (``has_transformer_engine_layers`` is real).
TRANSFORMER_ENGINE = _functions(
    _TE,
    "Use mixed_precision='fp8' with AORecipeKwargs (torchao).",
    "apply_fp8_autowrap",
    "contextual_fp8_autocast",
    "convert_model",
)

#: ``accelerate.utils.torch_xla``.
TORCH_XLA = _functions(_XLA, "pip install torch_xla matching your torch release.", "install_xla")

#: The launchers of ``accelerate.utils.launch`` that accel does not have.
LAUNCHERS = {
    **_functions(
        "DeepSpeed's own multi-machine launcher (the deepspeed command with a hostfile), which "
        "accel does not use",
        "accel launch --use_deepspeed starts DeepSpeed runs through torchrun.",
        "prepare_deepspeed_cmd_env",
    ),
    **_functions(
        "Amazon SageMaker launching, which accel does not implement",
        "",
        "prepare_sagemager_args_inputs",
    ),
}
