"""The string enums: equality with their values, membership, ``.list()`` and error messages."""

from __future__ import annotations

import pytest

from accel_state import (
    BaseEnum,
    ComputeEnvironment,
    DistributedType,
    DynamoBackend,
    LoggerType,
    PrecisionType,
    RNGType,
    SageMakerDistributedType,
)
from accel_state.enums import FP8BackendType

ACCELERATE_DISTRIBUTED_TYPES = [
    "NO",
    "MULTI_CPU",
    "MULTI_GPU",
    "MULTI_NPU",
    "MULTI_MLU",
    "MULTI_SDAA",
    "MULTI_MUSA",
    "MULTI_XPU",
    "DEEPSPEED",
    "FSDP",
    "XLA",
    "MEGATRON_LM",
    "MULTI_HPU",
    "MULTI_NEURON",
]


def test_distributed_type_has_exactly_accelerates_members() -> None:
    assert DistributedType.list() == ACCELERATE_DISTRIBUTED_TYPES
    for name in ACCELERATE_DISTRIBUTED_TYPES:
        assert DistributedType[name].value == name


def test_members_compare_equal_to_their_values() -> None:
    assert DistributedType.MULTI_CPU == "MULTI_CPU"
    assert "MULTI_CPU" == DistributedType.MULTI_CPU
    assert DistributedType.MULTI_CPU != "MULTI_GPU"
    assert PrecisionType.BF16 == "bf16"
    assert isinstance(PrecisionType.BF16, str)
    assert str(PrecisionType.BF16) == "bf16"
    assert {"bf16": 1}[PrecisionType.BF16] == 1  # hashes like the string


def test_str_is_accelerates() -> None:
    # Accelerate's (str, Enum) types print as Class.MEMBER; its BaseEnum types as the value.
    assert str(DistributedType.FSDP) == f"{DistributedType.FSDP}" == "DistributedType.FSDP"
    assert str(ComputeEnvironment.LOCAL_MACHINE) == "ComputeEnvironment.LOCAL_MACHINE"
    assert str(SageMakerDistributedType.NO) == "SageMakerDistributedType.NO"
    assert str(FP8BackendType.AO) == "FP8BackendType.AO"
    assert f"{DistributedType.FSDP:>25}".endswith("DistributedType.FSDP")
    assert DistributedType.FSDP.value == "FSDP"
    assert str(PrecisionType.FP16) == "fp16"
    assert str(DynamoBackend.INDUCTOR) == "INDUCTOR"


def test_construction_from_value() -> None:
    assert PrecisionType("fp16") is PrecisionType.FP16
    assert DistributedType("DEEPSPEED") is DistributedType.DEEPSPEED
    assert RNGType("generator") is RNGType.GENERATOR


def test_contains_tests_values_and_members() -> None:
    assert "fp16" in PrecisionType
    assert PrecisionType.FP16 in PrecisionType
    assert "fp32" not in PrecisionType
    assert "FP16" not in PrecisionType  # values, not member names
    assert "MULTI_GPU" in DistributedType
    assert "cuda" in RNGType
    assert 3 not in PrecisionType
    assert None not in DistributedType


def test_list_returns_plain_strings_in_definition_order() -> None:
    assert PrecisionType.list() == ["no", "fp8", "fp16", "bf16"]
    assert all(type(v) is str for v in PrecisionType.list())
    assert RNGType.list() == [
        "torch",
        "cuda",
        "mlu",
        "sdaa",
        "musa",
        "npu",
        "xla",
        "xpu",
        "hpu",
        "generator",
    ]
    assert SageMakerDistributedType.list() == ["NO", "DATA_PARALLEL", "MODEL_PARALLEL"]
    assert ComputeEnvironment.list() == ["LOCAL_MACHINE", "AMAZON_SAGEMAKER"]
    assert "tensorboard" in LoggerType and "all" in LoggerType
    assert "INDUCTOR" in DynamoBackend and "NO" in DynamoBackend


@pytest.mark.parametrize(
    ("enum", "bad"),
    [
        (PrecisionType, "fp32"),
        (DistributedType, "MULTI_TPU"),
        (RNGType, "numpy"),
        (LoggerType, "x"),
    ],
)
def test_invalid_value_lists_the_choices(enum: type[BaseEnum], bad: str) -> None:
    with pytest.raises(ValueError) as info:
        enum(bad)
    message = str(info.value)
    assert repr(bad) in message
    assert enum.__name__ in message
    for choice in enum.list():
        assert choice in message


def test_every_enum_is_a_base_enum() -> None:
    for enum in (
        ComputeEnvironment,
        DistributedType,
        DynamoBackend,
        LoggerType,
        PrecisionType,
        RNGType,
        SageMakerDistributedType,
    ):
        assert issubclass(enum, BaseEnum)
        assert issubclass(enum, str)
