"""Forward wrapping: autocast in, fp32 out, fully undoable, picklable and deep-copyable.

``convert_to_fp32`` and ``ConvertOutputsToFp32`` cast half-precision outputs back to fp32
through nested structures; ``wrap_forward`` / ``unwrap_forward`` install and remove the
instance-level forward wrapper without touching the class. Unlike Accelerate, whose wrapped
forward raises ``PicklingError``, accel's wrapped models pickle and deep-copy: the tests below
document that.
"""

from __future__ import annotations

import copy
import functools
import inspect
import io
import pickle
from collections import namedtuple
from typing import Any

import pytest
import torch

from accel_amp import (
    AutocastKwargs,
    ConvertOutputsToFp32,
    PrecisionPolicy,
    convert_outputs_to_fp32,
    convert_to_fp32,
    is_forward_wrapped,
    unwrap_forward,
    wrap_forward,
)

Pair = namedtuple("Pair", ["first", "second"])


class Output(dict):  # type: ignore[type-arg]
    """A ``ModelOutput``-style dict subclass."""


class Probe(torch.nn.Module):
    """Returns its Linear output and whether autocast was on while it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> dict[str, Any]:
        """Observe the autocast state from inside the forward."""
        return {
            "out": self.linear(x) * scale,
            "autocast": torch.is_autocast_enabled("cpu"),
            "autocast_dtype": torch.get_autocast_dtype("cpu"),
        }


class Plain(torch.nn.Module):
    """Returns its Linear output only."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the linear layer."""
        return self.linear(x)


def half_output(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A module-level function returning a bf16 tensor (picklable by reference)."""
    return x.to(torch.bfloat16), 7


def scaled_forward(module: Plain, x: torch.Tensor, factor: float) -> dict[str, Any]:
    """A module-level function used through ``functools.partial`` as an instance forward."""
    return {"out": module.linear(x) * factor, "autocast": torch.is_autocast_enabled("cpu")}


BF16 = PrecisionPolicy.resolve("bf16", "cpu")
FP16 = PrecisionPolicy.resolve("fp16", "cpu")


@pytest.fixture
def x() -> torch.Tensor:
    return torch.randn(2, 4)


def _record_linear_dtype(model: torch.nn.Module) -> list[torch.dtype]:
    seen: list[torch.dtype] = []

    def hook(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
        seen.append(output.dtype)

    model.linear.register_forward_hook(hook)  # type: ignore[union-attr]
    return seen


# --------------------------------------------------------------------------------------------
# convert_to_fp32 / ConvertOutputsToFp32
# --------------------------------------------------------------------------------------------


def test_convert_to_fp32_single_tensor() -> None:
    half = torch.tensor([1.5, -2.0], dtype=torch.float16)
    result = convert_to_fp32(half)
    assert result.dtype == torch.float32
    assert torch.equal(result, torch.tensor([1.5, -2.0]))


def test_convert_to_fp32_nested_structures_keep_their_types() -> None:
    fp16 = torch.tensor([1.0, 2.5], dtype=torch.float16)
    bf16 = torch.tensor([3.0, -4.0], dtype=torch.bfloat16)
    fp32 = torch.tensor([0.5])
    ints = torch.tensor([1, 2, 3])
    data = {
        "list": [fp16, (bf16, ints)],
        "pair": Pair(fp32, bf16),
        "output": Output(logits=fp16, labels=ints),
        "text": "kept",
        "number": 3,
    }
    result = convert_to_fp32(data)

    assert type(result) is dict
    assert type(result["list"]) is list
    assert type(result["list"][1]) is tuple
    assert type(result["pair"]) is Pair
    assert type(result["output"]) is Output

    assert result["list"][0].dtype == torch.float32
    assert torch.equal(result["list"][0], fp16.float())
    assert result["list"][1][0].dtype == torch.float32
    assert torch.equal(result["list"][1][0], bf16.float())
    assert result["pair"].second.dtype == torch.float32
    assert result["output"]["logits"].dtype == torch.float32

    assert result["pair"].first is fp32
    assert result["list"][1][1] is ints
    assert result["output"]["labels"] is ints
    assert result["text"] == "kept"
    assert result["number"] == 3


def test_convert_to_fp32_leaves_the_input_unchanged() -> None:
    bf16 = torch.ones(2, dtype=torch.bfloat16)
    data = [bf16]
    convert_to_fp32(data)
    assert data[0] is bf16
    assert bf16.dtype == torch.bfloat16


def test_convert_outputs_to_fp32_keeps_wrapped_and_name() -> None:
    wrapped = convert_outputs_to_fp32(half_output)
    assert isinstance(wrapped, ConvertOutputsToFp32)
    assert wrapped.__wrapped__ is half_output
    assert wrapped.__name__ == "half_output"
    assert wrapped.__doc__ == half_output.__doc__
    assert inspect.signature(wrapped) == inspect.signature(half_output)
    tensor, number = wrapped(torch.ones(3))
    assert tensor.dtype == torch.float32
    assert number == 7


def test_convert_outputs_to_fp32_class_directly() -> None:
    wrapped = ConvertOutputsToFp32(half_output)
    assert wrapped.__wrapped__ is half_output
    assert wrapped.__name__ == "half_output"
    assert wrapped(torch.ones(3))[0].dtype == torch.float32


def test_convert_outputs_to_fp32_pickles() -> None:
    wrapped = convert_outputs_to_fp32(half_output)
    restored = pickle.loads(pickle.dumps(wrapped))
    assert restored.__wrapped__ is half_output
    assert restored(torch.ones(3))[0].dtype == torch.float32


# --------------------------------------------------------------------------------------------
# wrap_forward
# --------------------------------------------------------------------------------------------


def test_wrap_forward_bf16_autocasts_inside_and_returns_fp32(x: torch.Tensor) -> None:
    model = Probe()
    seen = _record_linear_dtype(model)
    assert wrap_forward(model, BF16) is model
    assert is_forward_wrapped(model)

    result = model(x)
    assert seen == [torch.bfloat16]
    assert result["autocast"] is True
    assert result["autocast_dtype"] == torch.bfloat16
    assert result["out"].dtype == torch.float32
    assert not torch.is_autocast_enabled("cpu")


def test_wrap_forward_fp16_on_cpu_computes_in_float16(x: torch.Tensor) -> None:
    model = Probe()
    seen = _record_linear_dtype(model)
    wrap_forward(model, FP16)
    result = model(x)
    assert seen == [torch.float16]
    assert result["out"].dtype == torch.float32


def test_wrap_forward_direct_forward_call_is_wrapped_too(x: torch.Tensor) -> None:
    model = Probe()
    wrap_forward(model, BF16)
    result = model.forward(x, scale=2.0)
    assert result["autocast"] is True
    assert result["out"].dtype == torch.float32


def test_wrap_forward_keeps_the_signature() -> None:
    model = Probe()
    before = inspect.signature(model.forward)
    wrap_forward(model, BF16)
    assert inspect.signature(model.forward) == before
    assert list(inspect.signature(model.forward).parameters) == ["x", "scale"]


def test_wrap_forward_does_not_touch_the_class(x: torch.Tensor) -> None:
    class_forward = Probe.forward
    model = Probe()
    wrap_forward(model, BF16)
    assert type(model).forward is class_forward
    assert "forward" in model.__dict__
    other = Probe()
    assert not is_forward_wrapped(other)
    assert other(x)["autocast"] is False


def test_wrap_forward_with_autocast_kwargs_disabled(x: torch.Tensor) -> None:
    model = Probe()
    seen = _record_linear_dtype(model)
    wrap_forward(model, BF16, AutocastKwargs(enabled=False))
    result = model(x)
    assert result["autocast"] is False
    assert seen == [torch.float32]
    assert result["out"].dtype == torch.float32


def test_wrap_forward_with_autocast_kwargs_dict(x: torch.Tensor) -> None:
    model = Probe()
    wrap_forward(model, BF16, {"enabled": False})
    assert model(x)["autocast"] is False


def test_wrap_forward_with_a_bad_autocast_kwargs_type() -> None:
    with pytest.raises(TypeError, match="AutocastKwargs"):
        wrap_forward(Probe(), BF16, autocast_kwargs=42)


def test_wrap_forward_with_policy_no_leaves_the_model_alone(x: torch.Tensor) -> None:
    model = Probe()
    before = dict(model.__dict__)
    assert wrap_forward(model, PrecisionPolicy.resolve("no", "cpu")) is model
    assert not is_forward_wrapped(model)
    assert "forward" not in model.__dict__
    assert model.__dict__.keys() == before.keys()
    assert model(x)["autocast"] is False


def test_wrap_forward_with_an_engine_owned_policy_leaves_the_model_alone() -> None:
    model = Probe()
    policy = PrecisionPolicy.resolve("bf16", "cpu", distributed_type="DEEPSPEED")
    wrap_forward(model, policy)
    assert not is_forward_wrapped(model)
    assert "forward" not in model.__dict__


@pytest.mark.parametrize("not_a_module", [lambda t: t, object(), "model"])
def test_wrap_forward_on_a_non_module_is_a_type_error(not_a_module: Any) -> None:
    with pytest.raises(TypeError, match="torch.nn.Module"):
        wrap_forward(not_a_module, BF16)


def test_wrapping_twice_does_not_nest(x: torch.Tensor) -> None:
    model = Probe()
    seen = _record_linear_dtype(model)
    wrap_forward(model, BF16)
    wrap_forward(model, FP16)
    result = model(x)
    # A nested bf16 wrapper inside the fp16 one would make the linear compute in bf16.
    assert seen == [torch.float16]
    assert result["out"].dtype == torch.float32

    unwrap_forward(model, keep_fp32_wrapper=False)
    assert not is_forward_wrapped(model)
    assert "forward" not in model.__dict__
    assert model(x)["autocast"] is False


# --------------------------------------------------------------------------------------------
# unwrap_forward
# --------------------------------------------------------------------------------------------


def test_unwrap_keeping_the_fp32_wrapper_keeps_it_wrapped(x: torch.Tensor) -> None:
    model = Probe()
    wrap_forward(model, BF16)
    assert unwrap_forward(model, keep_fp32_wrapper=True) is model
    assert is_forward_wrapped(model)
    result = model(x)
    assert result["autocast"] is True
    assert result["out"].dtype == torch.float32


def test_unwrap_default_keeps_the_fp32_wrapper(x: torch.Tensor) -> None:
    model = Probe()
    wrap_forward(model, BF16)
    unwrap_forward(model)
    assert is_forward_wrapped(model)
    assert model(x)["autocast"] is True


def test_unwrap_removes_the_instance_attributes(x: torch.Tensor) -> None:
    model = Probe()
    expected = model(x)["out"]
    keys_before = set(model.__dict__)
    wrap_forward(model, BF16)
    assert unwrap_forward(model, keep_fp32_wrapper=False) is model

    assert "forward" not in model.__dict__
    assert "_original_forward" not in model.__dict__
    assert set(model.__dict__) == keys_before
    assert not is_forward_wrapped(model)
    assert model.forward.__func__ is Probe.forward  # type: ignore[attr-defined]
    result = model(x)
    assert result["autocast"] is False
    assert torch.equal(result["out"], expected)


def test_unwrap_returns_plain_outputs_again(x: torch.Tensor) -> None:
    model = Plain()
    wrap_forward(model, BF16)
    unwrap_forward(model, keep_fp32_wrapper=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # No fp32 conversion left: the caller's autocast decides the output dtype.
        assert model(x).dtype == torch.bfloat16


def test_unwrap_of_a_never_wrapped_model_is_a_no_op(x: torch.Tensor) -> None:
    model = Probe()
    assert unwrap_forward(model, keep_fp32_wrapper=False) is model
    assert "forward" not in model.__dict__
    assert model(x)["autocast"] is False


def test_unwrap_restores_an_instance_lambda_forward(x: torch.Tensor) -> None:
    model = Plain()

    def user_forward(t: torch.Tensor) -> dict[str, Any]:
        return {"out": model.linear(t), "autocast": torch.is_autocast_enabled("cpu")}

    instance_forward = lambda t: user_forward(t)  # noqa: E731
    model.forward = instance_forward  # type: ignore[method-assign]
    wrap_forward(model, BF16)
    result = model(x)
    assert result["autocast"] is True
    assert result["out"].dtype == torch.float32

    unwrap_forward(model, keep_fp32_wrapper=False)
    assert model.__dict__["forward"] is instance_forward
    assert "_original_forward" not in model.__dict__
    assert model(x)["autocast"] is False


def test_unwrap_restores_an_instance_partial_forward(x: torch.Tensor) -> None:
    model = Plain()
    partial = functools.partial(scaled_forward, model, factor=2.0)
    model.forward = partial  # type: ignore[method-assign]
    wrap_forward(model, BF16)
    assert model(x)["autocast"] is True

    unwrap_forward(model, keep_fp32_wrapper=False)
    assert model.__dict__["forward"] is partial
    assert not is_forward_wrapped(model)
    assert model(x)["autocast"] is False


def test_unwrap_keeps_a_forward_the_user_replaced_after_wrapping(x: torch.Tensor) -> None:
    model = Probe()
    wrap_forward(model, BF16)

    def replacement(t: torch.Tensor) -> str:
        return "replaced"

    model.forward = replacement  # type: ignore[method-assign]
    unwrap_forward(model, keep_fp32_wrapper=False)
    assert model.__dict__["forward"] is replacement
    assert model(x) == "replaced"
    assert not is_forward_wrapped(model)


def test_rewrap_after_unwrap(x: torch.Tensor) -> None:
    model = Probe()
    wrap_forward(model, BF16)
    unwrap_forward(model, keep_fp32_wrapper=False)
    wrap_forward(model, FP16)
    result = model(x)
    assert result["autocast_dtype"] == torch.float16
    unwrap_forward(model, keep_fp32_wrapper=False)
    assert "forward" not in model.__dict__


# --------------------------------------------------------------------------------------------
# Pickling and deep copies (Accelerate raises PicklingError here; accel supports it)
# --------------------------------------------------------------------------------------------


def test_wrapped_model_pickles_and_stays_wrapped(x: torch.Tensor) -> None:
    model = wrap_forward(Probe(), BF16)
    expected = model(x)["out"]
    restored = pickle.loads(pickle.dumps(model))

    assert restored is not model
    assert is_forward_wrapped(restored)
    result = restored(x)
    assert result["autocast"] is True
    assert result["autocast_dtype"] == torch.bfloat16
    assert result["out"].dtype == torch.float32
    assert torch.equal(result["out"], expected)
    assert inspect.signature(restored.forward) == inspect.signature(Probe().forward)


def test_unpickled_wrapper_is_bound_to_the_copy(x: torch.Tensor) -> None:
    model = wrap_forward(Probe(), BF16)
    restored = pickle.loads(pickle.dumps(model))
    with torch.no_grad():
        restored.linear.bias.add_(100.0)
    assert not torch.allclose(restored(x)["out"], model(x)["out"])


def test_unpickled_wrapped_model_can_be_unwrapped(x: torch.Tensor) -> None:
    restored = pickle.loads(pickle.dumps(wrap_forward(Probe(), BF16)))
    unwrap_forward(restored, keep_fp32_wrapper=False)
    assert "forward" not in restored.__dict__
    assert "_original_forward" not in restored.__dict__
    assert not is_forward_wrapped(restored)
    assert restored(x)["autocast"] is False


def test_wrapped_model_round_trips_through_torch_save(x: torch.Tensor) -> None:
    model = wrap_forward(Probe(), BF16)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    assert is_forward_wrapped(restored)
    assert restored(x)["autocast"] is True
    assert torch.equal(restored(x)["out"], model(x)["out"])


def test_deepcopy_gives_an_independent_wrapped_copy(x: torch.Tensor) -> None:
    model = wrap_forward(Probe(), BF16)
    before = model(x)["out"]
    clone = copy.deepcopy(model)

    assert is_forward_wrapped(clone)
    assert clone(x)["autocast"] is True
    assert torch.equal(clone(x)["out"], before)

    with torch.no_grad():
        clone.linear.weight.add_(1.0)
    assert torch.equal(model(x)["out"], before)
    changed = clone(x)
    assert not torch.allclose(changed["out"], before)
    assert changed["out"].dtype == torch.float32

    unwrap_forward(clone, keep_fp32_wrapper=False)
    assert "forward" not in clone.__dict__
    assert is_forward_wrapped(model)
    assert model(x)["autocast"] is True
