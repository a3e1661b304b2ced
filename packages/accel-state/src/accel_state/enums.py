"""The shared vocabulary: distributed types, precisions, RNG kinds and the other string enums.

These are names only; the behaviour behind a precision lives in accel-amp, the behaviour
behind a distributed type in the state and the engines. Every enum is a ``str`` enum, so
``DistributedType.MULTI_CPU == "MULTI_CPU"``; ``"fp16" in PrecisionType`` and
``PrecisionType.list()`` work as in Accelerate.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = [
    "BaseEnum",
    "ComputeEnvironment",
    "DistributedType",
    "DynamoBackend",
    "EnumWithContains",
    "FP8BackendType",
    "LoggerType",
    "PrecisionType",
    "RNGType",
    "SageMakerDistributedType",
]


class EnumWithContains(enum.EnumMeta):
    """Lets ``"value" in SomeEnum`` test values as well as members."""

    def __contains__(cls, item: object) -> bool:
        if isinstance(item, cls):
            return True
        return any(item == member.value for member in cls)  # type: ignore[var-annotated]


class BaseEnum(str, enum.Enum, metaclass=EnumWithContains):
    """A ``str`` enum whose members compare equal to their values."""

    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def list(cls) -> list[str]:
        """Return the values of every member, in definition order."""
        return [str(member.value) for member in cls]

    @classmethod
    def _missing_(cls, value: Any) -> Any:
        raise ValueError(
            f"{value!r} is not a valid {cls.__name__}: choose one of {', '.join(cls.list())}"
        )


class _QualifiedEnum(BaseEnum):
    """A ``BaseEnum`` whose ``str()`` is ``"Class.MEMBER"``, as Accelerate's plain str enums.

    Accelerate 1.15 derives ``DistributedType``, ``ComputeEnvironment``,
    ``SageMakerDistributedType`` and ``FP8BackendType`` from ``(str, enum.Enum)``, whose
    ``str()`` and f-string form is ``"DistributedType.MULTI_CPU"`` on Python 3.11; scripts and
    logs that print them read the same with accel. ``.value`` and comparisons with the plain
    string (``== "MULTI_CPU"``) are unchanged.
    """

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    def __format__(self, format_spec: str) -> str:
        return format(str(self), format_spec)


class DistributedType(_QualifiedEnum):
    """How the processes of a run are organised."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


class SageMakerDistributedType(_QualifiedEnum):
    """Distributed types of Amazon SageMaker jobs (kept for config-file compatibility)."""

    NO = "NO"
    DATA_PARALLEL = "DATA_PARALLEL"
    MODEL_PARALLEL = "MODEL_PARALLEL"


class ComputeEnvironment(_QualifiedEnum):
    """Where a launch config is meant to run."""

    LOCAL_MACHINE = "LOCAL_MACHINE"
    AMAZON_SAGEMAKER = "AMAZON_SAGEMAKER"


class FP8BackendType(_QualifiedEnum):
    """FP8 backends by name (accel drives ``AO``, torchao, only)."""

    NO = "NO"
    TE = "TE"
    MSAMP = "MSAMP"
    AO = "AO"


class DynamoBackend(BaseEnum):
    """``torch.compile`` backends accepted by the dynamo plugin (``NO`` disables it)."""

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    IPEX = "IPEX"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"


class LoggerType(BaseEnum):
    """Experiment trackers known by name."""

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"
    TRACKIO = "trackio"


class PrecisionType(BaseEnum):
    """Mixed-precision modes: ``no``, ``fp8``, ``fp16``, ``bf16``."""

    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


class RNGType(BaseEnum):
    """Random number generators that can be synchronised across processes."""

    TORCH = "torch"
    CUDA = "cuda"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    NPU = "npu"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    GENERATOR = "generator"
