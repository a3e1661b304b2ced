"""PrecisionPolicy, the kwargs handlers, and the AcceleratorState-driven autocast helpers.

Covers what ``"no"``/``"fp16"``/``"bf16"``/``"fp8"`` resolve to on CPU (fp16 on CPU is real:
float16 autocast plus a CPU GradScaler), the errors for unknown or unsupported settings, the
one-line ``describe()`` with its bytes-per-parameter arithmetic, ``autocast_context()``,
``GradScalerKwargs`` validation, and ``get_mixed_precision_context_manager`` /
``get_grad_scaler``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from typing import Any

import pytest
import torch

import accel_amp.autocast
import accel_amp.policy
from accel_amp import (
    MIXED_PRECISION_CHOICES,
    AcceleratedOptimizer,
    AutocastKwargs,
    GradScalerKwargs,
    PrecisionPolicy,
    get_grad_scaler,
    get_mixed_precision_context_manager,
    resolve_fp8_backend,
    validate_mixed_precision,
)
from accel_state import AcceleratorState, DistributedType

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None


def _linear_output_dtype(context: contextlib.AbstractContextManager[Any]) -> torch.dtype:
    """The dtype a float32 ``nn.Linear`` produces inside ``context``."""
    layer = torch.nn.Linear(4, 3)
    with context:
        return layer(torch.randn(2, 4)).dtype


def _params() -> list[torch.nn.Parameter]:
    return list(torch.nn.Linear(4, 3).parameters())


# --------------------------------------------------------------------------------------------
# resolve
# --------------------------------------------------------------------------------------------


def test_resolve_no_keeps_everything_in_param_dtype() -> None:
    policy = PrecisionPolicy.resolve("no", "cpu")
    assert policy.mixed_precision == "no"
    assert policy.device_type == "cpu"
    assert policy.param_dtype == torch.float32
    assert policy.compute_dtype == torch.float32
    assert policy.reduce_dtype == torch.float32
    assert policy.output_dtype is None
    assert policy.autocast is False
    assert policy.scaler is False
    assert policy.fp8_backend is None
    assert policy.owner == "accel"


def test_resolve_none_and_default_device_mean_no_on_cpu() -> None:
    policy = PrecisionPolicy.resolve(None)
    assert policy.mixed_precision == "no"
    assert policy.device_type == "cpu"
    assert policy.autocast is False


def test_resolve_no_reports_the_models_param_dtype() -> None:
    policy = PrecisionPolicy.resolve("no", "cpu", param_dtype=torch.bfloat16)
    assert policy.param_dtype == torch.bfloat16
    assert policy.compute_dtype == torch.bfloat16
    assert policy.reduce_dtype == torch.bfloat16


def test_resolve_fp16_on_cpu_is_real_autocast_with_a_scaler() -> None:
    policy = PrecisionPolicy.resolve("fp16", "cpu")
    assert policy.mixed_precision == "fp16"
    assert policy.device_type == "cpu"
    assert policy.param_dtype == torch.float32
    assert policy.compute_dtype == torch.float16
    assert policy.reduce_dtype == torch.float32
    assert policy.output_dtype == torch.float32
    assert policy.autocast is True
    assert policy.scaler is True
    assert policy.owner == "accel"


def test_resolve_fp16_accepts_a_torch_device() -> None:
    policy = PrecisionPolicy.resolve("fp16", torch.device("cpu"))
    assert policy.device_type == "cpu"
    assert policy.compute_dtype == torch.float16


def test_resolve_fp16_on_cpu_without_torch_support_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(accel_amp.policy, "cpu_supports_fp16", lambda: False)
    with pytest.raises(ValueError, match="fp16") as excinfo:
        PrecisionPolicy.resolve("fp16", "cpu")
    assert "bf16" in str(excinfo.value)
    assert torch.__version__ in str(excinfo.value)


def test_resolve_fp16_on_a_device_without_float16_autocast_is_an_error() -> None:
    with pytest.raises(ValueError, match="fp16") as excinfo:
        PrecisionPolicy.resolve("fp16", "meta")
    assert "'meta'" in str(excinfo.value)
    assert "bf16" in str(excinfo.value)


def test_resolve_bf16_on_cpu_autocasts_to_bfloat16_without_a_scaler() -> None:
    policy = PrecisionPolicy.resolve("bf16", "cpu")
    assert policy.mixed_precision == "bf16"
    assert policy.param_dtype == torch.float32
    assert policy.compute_dtype == torch.bfloat16
    assert policy.reduce_dtype == torch.float32
    assert policy.output_dtype == torch.float32
    assert policy.autocast is True
    assert policy.scaler is False
    assert policy.fp8_backend is None
    assert policy.owner == "accel"


@pytest.mark.skipif(HAS_TORCHAO, reason="torchao is installed")
def test_resolve_fp8_without_torchao_names_the_extra() -> None:
    with pytest.raises(ImportError) as excinfo:
        PrecisionPolicy.resolve("fp8", "cpu")
    message = str(excinfo.value)
    assert 'pip install "accel-amp[fp8]"' in message
    assert "bf16" in message


@pytest.mark.skipif(HAS_TORCHAO, reason="torchao is installed")
def test_resolve_fp8_backend_without_torchao_names_the_extra() -> None:
    with pytest.raises(ImportError, match=r'pip install "accel-amp\[fp8\]"'):
        resolve_fp8_backend("AO")


def test_resolve_fp8_with_torchao_present_uses_ao_and_bfloat16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "torchao":
            return object()
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    policy = PrecisionPolicy.resolve("fp8", "cpu")
    assert policy.mixed_precision == "fp8"
    assert policy.fp8_backend == "AO"
    assert policy.compute_dtype == torch.bfloat16
    assert policy.output_dtype == torch.float32
    assert policy.autocast is True
    assert policy.scaler is False
    assert "fp8 linear layers via AO" in policy.describe()


@pytest.mark.parametrize("backend", ["TE", "te", "MSAMP"])
def test_resolve_fp8_with_an_unsupported_backend_is_a_value_error(backend: str) -> None:
    with pytest.raises(ValueError, match="torchao") as excinfo:
        PrecisionPolicy.resolve("fp8", "cpu", fp8_backend=backend)
    assert repr(backend) in str(excinfo.value)


def test_resolve_fp8_with_an_unknown_backend_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="'nope'"):
        resolve_fp8_backend("nope")


@pytest.mark.parametrize("bad", ["fp32", "float16", "half", "", "bf 16"])
def test_resolve_unknown_precision_lists_the_choices(bad: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        PrecisionPolicy.resolve(bad, "cpu")
    message = str(excinfo.value)
    assert repr(bad) in message
    for choice in ("no", "fp16", "bf16", "fp8"):
        assert repr(choice) in message


def test_validate_mixed_precision_names_the_argument() -> None:
    with pytest.raises(ValueError, match="my_arg='int8'"):
        validate_mixed_precision("int8", name="my_arg")
    assert MIXED_PRECISION_CHOICES == ("no", "fp16", "bf16", "fp8")


@pytest.mark.parametrize(
    ("given", "expected"),
    [("NO", "no"), ("No", "no"), ("FP16", "fp16"), ("Fp16", "fp16"), ("BF16", "bf16")],
)
def test_resolve_is_case_insensitive(given: str, expected: str) -> None:
    policy = PrecisionPolicy.resolve(given, "cpu")
    assert policy.mixed_precision == expected
    assert policy == PrecisionPolicy.resolve(expected, "cpu")


@pytest.mark.parametrize(
    ("precision", "compute"), [("fp16", torch.float16), ("bf16", torch.bfloat16)]
)
@pytest.mark.parametrize("distributed_type", [DistributedType.DEEPSPEED, "deepspeed"])
def test_resolve_under_deepspeed_leaves_precision_to_the_engine(
    precision: str, compute: torch.dtype, distributed_type: Any
) -> None:
    policy = PrecisionPolicy.resolve(precision, "cpu", distributed_type=distributed_type)
    assert policy.owner == "deepspeed"
    assert policy.autocast is False
    assert policy.scaler is False
    assert policy.output_dtype is None
    assert policy.compute_dtype == compute
    assert isinstance(policy.autocast_context(), contextlib.nullcontext)
    assert "deepspeed" in policy.describe()


def test_resolve_under_megatron_lm_leaves_precision_to_the_engine() -> None:
    policy = PrecisionPolicy.resolve("bf16", "cpu", distributed_type=DistributedType.MEGATRON_LM)
    assert policy.owner == "megatron-lm"
    assert policy.autocast is False
    assert policy.scaler is False


def test_resolve_no_under_deepspeed_is_plain_no() -> None:
    policy = PrecisionPolicy.resolve("no", "cpu", distributed_type=DistributedType.DEEPSPEED)
    assert policy == PrecisionPolicy.resolve("no", "cpu")


@pytest.mark.parametrize("distributed_type", [DistributedType.MULTI_CPU, DistributedType.FSDP])
def test_resolve_under_other_distributed_types_autocasts(distributed_type: Any) -> None:
    policy = PrecisionPolicy.resolve("bf16", "cpu", distributed_type=distributed_type)
    assert policy.owner == "accel"
    assert policy.autocast is True


def test_grad_scaler_kwargs_disabled_turns_the_fp16_scaler_off() -> None:
    policy = PrecisionPolicy.resolve("fp16", "cpu", scaler_kwargs=GradScalerKwargs(enabled=False))
    assert policy.scaler is False
    assert policy.autocast is True
    assert policy.compute_dtype == torch.float16
    assert "no loss scaler" in policy.describe()


def test_grad_scaler_kwargs_enabled_keeps_the_fp16_scaler() -> None:
    policy = PrecisionPolicy.resolve("fp16", "cpu", scaler_kwargs=GradScalerKwargs(init_scale=8.0))
    assert policy.scaler is True


def test_policy_is_frozen() -> None:
    policy = PrecisionPolicy.resolve("bf16", "cpu")
    with pytest.raises(AttributeError):
        policy.scaler = True  # type: ignore[misc]


# --------------------------------------------------------------------------------------------
# bytes_per_parameter / describe
# --------------------------------------------------------------------------------------------


def test_bytes_per_parameter_without_optimizer_has_unknown_state() -> None:
    policy = PrecisionPolicy.resolve("bf16", "cpu")
    assert policy.bytes_per_parameter() == {"weights": 4, "grads": 4, "optimizer_state": None}


@pytest.mark.parametrize(
    ("make_optimizer", "state_bytes", "name"),
    [
        (lambda params: torch.optim.AdamW(params), 8, "AdamW"),
        (lambda params: torch.optim.Adam(params), 8, "Adam"),
        (lambda params: torch.optim.AdamW(params, amsgrad=True), 12, "AdamW"),
        (lambda params: torch.optim.SGD(params, lr=0.1), 0, "SGD"),
        (lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.0), 0, "SGD"),
        (lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), 4, "SGD"),
        (lambda params: torch.optim.Adagrad(params), 4, "Adagrad"),
        (lambda params: torch.optim.RMSprop(params), 4, "RMSprop"),
        (lambda params: torch.optim.RMSprop(params, momentum=0.9, centered=True), 12, "RMSprop"),
    ],
)
def test_bytes_per_parameter_golden_values(
    make_optimizer: Any, state_bytes: int, name: str
) -> None:
    policy = PrecisionPolicy.resolve("bf16", "cpu")
    optimizer = make_optimizer(_params())
    assert policy.bytes_per_parameter(optimizer) == {
        "weights": 4,
        "grads": 4,
        "optimizer_state": state_bytes,
    }
    line = policy.describe(optimizer)
    assert f"optimizer {state_bytes} ({name}) = {8 + state_bytes}" in line


def test_bytes_per_parameter_follows_param_dtype() -> None:
    policy = PrecisionPolicy.resolve("bf16", "cpu", param_dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(_params())
    assert policy.bytes_per_parameter(optimizer) == {
        "weights": 2,
        "grads": 2,
        "optimizer_state": 4,
    }


def test_bytes_per_parameter_sees_through_accelerated_optimizer() -> None:
    AcceleratorState(cpu=True)
    optimizer = AcceleratedOptimizer(torch.optim.AdamW(_params()), device_placement=False)
    policy = PrecisionPolicy.resolve("fp16", "cpu")
    assert policy.bytes_per_parameter(optimizer)["optimizer_state"] == 8
    assert "optimizer 8 (AdamW) = 16" in policy.describe(optimizer)


def test_bytes_per_parameter_of_an_unknown_optimizer_is_none() -> None:
    class Custom(torch.optim.Optimizer):
        def __init__(self, params: Any) -> None:
            super().__init__(params, {"lr": 0.1})

    policy = PrecisionPolicy.resolve("bf16", "cpu")
    optimizer = Custom(_params())
    assert policy.bytes_per_parameter(optimizer)["optimizer_state"] is None
    assert "Adam-style adds 2 x param bytes" in policy.describe(optimizer)


def test_describe_adamw_golden_line() -> None:
    policy = PrecisionPolicy.resolve("bf16", "cpu")
    line = policy.describe(torch.optim.AdamW(_params()))
    assert line == (
        "accel precision: bf16 | autocast bfloat16 on cpu | params float32, grads reduced in "
        "float32, outputs float32 | no loss scaler | bytes/param: weights 4 + grads 4 + "
        "optimizer 8 (AdamW) = 16"
    )


def test_describe_without_optimizer_mentions_optimizer_state() -> None:
    line = PrecisionPolicy.resolve("bf16", "cpu").describe()
    assert "bytes/param: weights 4 + grads 4 + optimizer state" in line
    assert "= " not in line.split("bytes/param:")[1]


@pytest.mark.parametrize(
    ("precision", "dtype_name", "scaler_text"),
    [
        ("no", "float32", "no loss scaler"),
        ("fp16", "float16", "GradScaler"),
        ("bf16", "bfloat16", "no loss scaler"),
    ],
)
def test_describe_is_one_line_with_compute_dtype_and_scaler(
    precision: str, dtype_name: str, scaler_text: str
) -> None:
    policy = PrecisionPolicy.resolve(precision, "cpu")
    line = policy.describe()
    assert "\n" not in line
    assert line.startswith(f"accel precision: {precision} |")
    assert f"{'autocast' if policy.autocast else 'compute'} {dtype_name} on cpu" in line
    assert scaler_text in line
    assert str(policy) == line


def test_describe_fp16_says_gradscaler_and_bf16_does_not() -> None:
    assert "GradScaler" in PrecisionPolicy.resolve("fp16", "cpu").describe()
    assert "GradScaler" not in PrecisionPolicy.resolve("bf16", "cpu").describe()
    assert "no autocast" in PrecisionPolicy.resolve("no", "cpu").describe()


# --------------------------------------------------------------------------------------------
# autocast_context
# --------------------------------------------------------------------------------------------


def test_autocast_context_for_no_is_a_null_context() -> None:
    context = PrecisionPolicy.resolve("no", "cpu").autocast_context()
    assert isinstance(context, contextlib.nullcontext)
    assert _linear_output_dtype(context) == torch.float32


@pytest.mark.parametrize(
    ("precision", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16)]
)
def test_autocast_context_autocasts_to_the_compute_dtype(
    precision: str, dtype: torch.dtype
) -> None:
    policy = PrecisionPolicy.resolve(precision, "cpu")
    context = policy.autocast_context()
    assert isinstance(context, torch.autocast)
    assert context.device == "cpu"
    assert context.fast_dtype == dtype
    assert _linear_output_dtype(context) == dtype
    assert not torch.is_autocast_enabled("cpu")


def test_autocast_context_is_fresh_each_time() -> None:
    policy = PrecisionPolicy.resolve("bf16", "cpu")
    first, second = policy.autocast_context(), policy.autocast_context()
    assert first is not second
    with first, second:
        assert torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")


def test_autocast_kwargs_disabled_makes_an_fp32_island() -> None:
    policy = PrecisionPolicy.resolve("bf16", "cpu")
    context = policy.autocast_context(AutocastKwargs(enabled=False))
    assert _linear_output_dtype(context) == torch.float32


def test_autocast_kwargs_as_a_dict() -> None:
    policy = PrecisionPolicy.resolve("bf16", "cpu")
    assert _linear_output_dtype(policy.autocast_context({"enabled": False})) == torch.float32
    assert _linear_output_dtype(policy.autocast_context({"cache_enabled": False})) == (
        torch.bfloat16
    )


@pytest.mark.parametrize("bad", [["enabled", False], 3, "enabled=False"])
def test_autocast_kwargs_of_a_bad_type_is_a_type_error(bad: Any) -> None:
    policy = PrecisionPolicy.resolve("bf16", "cpu")
    with pytest.raises(TypeError, match="AutocastKwargs"):
        policy.autocast_context(bad)


# --------------------------------------------------------------------------------------------
# kwargs handlers
# --------------------------------------------------------------------------------------------


def test_autocast_kwargs_to_kwargs_returns_only_changed_fields() -> None:
    assert AutocastKwargs().to_kwargs() == {}
    assert AutocastKwargs(enabled=False).to_kwargs() == {"enabled": False}
    assert AutocastKwargs(cache_enabled=False).to_kwargs() == {"cache_enabled": False}


def test_grad_scaler_kwargs_to_kwargs_returns_only_changed_fields() -> None:
    assert GradScalerKwargs().to_kwargs() == {}
    assert GradScalerKwargs(init_scale=1024.0, growth_interval=10).to_kwargs() == {
        "init_scale": 1024.0,
        "growth_interval": 10,
    }
    assert GradScalerKwargs(enabled=False).to_kwargs() == {"enabled": False}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("init_scale", 0.0),
        ("init_scale", -1.0),
        ("init_scale", math.inf),
        ("init_scale", math.nan),
        ("growth_factor", 1.0),
        ("growth_factor", 0.5),
        ("backoff_factor", 0.0),
        ("backoff_factor", 1.0),
        ("backoff_factor", 1.5),
        ("backoff_factor", -0.5),
        ("growth_interval", 0),
        ("growth_interval", -5),
        ("growth_interval", True),
        ("growth_interval", 2.5),
    ],
)
def test_grad_scaler_kwargs_rejects_bad_values(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"GradScalerKwargs\\({field}="):
        GradScalerKwargs(**{field: value})


def test_grad_scaler_kwargs_accepts_boundary_values() -> None:
    kwargs = GradScalerKwargs(
        init_scale=1e-3, growth_factor=1.0001, backoff_factor=0.999, growth_interval=1
    )
    assert kwargs.growth_interval == 1


# --------------------------------------------------------------------------------------------
# AcceleratorState-driven helpers
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("precision", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16)]
)
def test_get_mixed_precision_context_manager_autocasts_on_cpu(
    precision: str, dtype: torch.dtype
) -> None:
    AcceleratorState(mixed_precision=precision, cpu=True)
    context = get_mixed_precision_context_manager(native_amp=True)
    assert isinstance(context, torch.autocast)
    assert context.fast_dtype == dtype
    assert _linear_output_dtype(context) == dtype


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_get_mixed_precision_context_manager_without_native_amp_does_nothing(
    precision: str,
) -> None:
    AcceleratorState(mixed_precision=precision, cpu=True)
    context = get_mixed_precision_context_manager(native_amp=False)
    assert isinstance(context, contextlib.nullcontext)
    assert _linear_output_dtype(context) == torch.float32


def test_get_mixed_precision_context_manager_passes_autocast_kwargs() -> None:
    AcceleratorState(mixed_precision="bf16", cpu=True)
    context = get_mixed_precision_context_manager(
        native_amp=True, autocast_kwargs=AutocastKwargs(enabled=False)
    )
    assert _linear_output_dtype(context) == torch.float32


def test_get_grad_scaler_on_cpu_scales_by_init_scale() -> None:
    AcceleratorState(mixed_precision="fp16", cpu=True)
    scaler = get_grad_scaler(**GradScalerKwargs(init_scale=8.0).to_kwargs())
    assert isinstance(scaler, torch.amp.GradScaler)
    assert scaler.is_enabled()
    scaled = scaler.scale(torch.tensor([2.0, -0.5]))
    assert torch.equal(scaled, torch.tensor([16.0, -4.0]))


def test_get_grad_scaler_default_scale_is_65536() -> None:
    AcceleratorState(mixed_precision="fp16", cpu=True)
    scaler = get_grad_scaler()
    assert scaler.scale(torch.tensor(1.0)).item() == 65536.0


def test_get_grad_scaler_on_cpu_without_torch_support_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    AcceleratorState(mixed_precision="fp16", cpu=True)
    monkeypatch.setattr(accel_amp.autocast, "cpu_supports_fp16", lambda: False)
    with pytest.raises(ValueError, match="bf16"):
        get_grad_scaler()
