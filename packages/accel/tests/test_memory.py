"""find_executable_batch_size, release_memory and the out-of-memory classifier.

The golden batch-size sequence follows Accelerate's memory tests: from 128, every
out-of-memory failure multiplies the batch size by 0.9 and truncates.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

from accel import memory
from accel.memory import (
    find_executable_batch_size,
    release_memory,
    should_reduce_batch_size,
)

GOLDEN_FROM_128 = [128, 115, 103, 92, 82, 73, 65, 58, 52, 46, 41, 36, 32, 28, 25, 22, 19, 17, 15]
GOLDEN_FROM_128 += [13, 11, 9]


def _oom() -> RuntimeError:
    return RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB")


# --- should_reduce_batch_size -----------------------------------------------------------------


@pytest.mark.parametrize(
    "message",
    [
        "CUDA out of memory. Tried to allocate 2.00 GiB",
        "XPU out of memory. Tried to allocate 1.00 GiB",
        "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if ...",
        "[enforce fail at alloc_cpu.cpp:83] DefaultCPUAllocator: can't allocate memory: you tried",
        "MPS backend out of memory (MPS allocated: 1.00 GB)",
    ],
)
def test_out_of_memory_messages_are_recognised(message: str) -> None:
    assert should_reduce_batch_size(RuntimeError(message))


def test_torch_out_of_memory_error_is_recognised() -> None:
    oom_type = getattr(torch, "OutOfMemoryError", None)
    if oom_type is None:
        pytest.skip("this torch has no torch.OutOfMemoryError")
    assert should_reduce_batch_size(oom_type("whatever the message"))


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("shape mismatch"),
        ValueError("CUDA out of memory."),  # right text, wrong type
        KeyError("x"),
        RuntimeError(),
    ],
)
def test_other_exceptions_are_not_out_of_memory(error: BaseException) -> None:
    assert not should_reduce_batch_size(error)


# --- find_executable_batch_size ---------------------------------------------------------------


def test_golden_sequence_with_bare_decorator() -> None:
    tried: list[int] = []

    @find_executable_batch_size
    def train(batch_size: int) -> int:
        tried.append(batch_size)
        if batch_size > 10:
            raise _oom()
        return batch_size * 2

    assert train() == 18
    assert tried == GOLDEN_FROM_128
    assert train.__name__ == "train"


def test_golden_sequence_with_arguments_and_extra_parameters() -> None:
    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=128)
    def train(batch_size: int, name: str, *, scale: int = 1) -> tuple[int, str]:
        tried.append(batch_size)
        if batch_size != 8:
            raise _oom()
        return batch_size * scale, name

    assert train("hello", scale=3) == (24, "hello")
    assert tried == [*GOLDEN_FROM_128, 8]


def test_starting_batch_size_is_respected() -> None:
    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=64)
    def train(batch_size: int) -> None:
        tried.append(batch_size)
        if batch_size > 50:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to ...")

    train()
    assert tried == [64, 57, 51, 45]


def test_first_success_runs_only_once() -> None:
    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=32)
    def train(batch_size: int) -> str:
        tried.append(batch_size)
        return "done"

    assert train() == "done"
    assert tried == [32]


def test_a_later_call_starts_from_the_last_batch_size_that_was_tried() -> None:
    tried: list[int] = []
    limit = {"value": 100}

    @find_executable_batch_size(starting_batch_size=128)
    def train(batch_size: int) -> None:
        tried.append(batch_size)
        if batch_size > limit["value"]:
            raise _oom()

    train()
    assert tried == [128, 115, 103, 92]
    tried.clear()
    train()
    assert tried == [92]


def test_passing_the_batch_size_raises_type_error() -> None:
    @find_executable_batch_size(starting_batch_size=16)
    def train(batch_size: int, model: str) -> None:
        raise AssertionError("must not run")

    with pytest.raises(TypeError) as info:
        train(16, "net")
    message = str(info.value)
    assert "Batch size was passed into `train` as the first argument when called." in message
    assert "train(model='net')" in message


def test_passing_the_batch_size_to_a_one_parameter_function_raises() -> None:
    @find_executable_batch_size
    def train(batch_size: int) -> None:
        raise AssertionError("must not run")

    with pytest.raises(TypeError, match="Batch size was passed into `train`"):
        train(8)


def test_var_positional_functions_are_not_checked() -> None:
    @find_executable_batch_size(starting_batch_size=4)
    def train(batch_size: int, *rest: Any) -> tuple[int, tuple[Any, ...]]:
        return batch_size, rest

    assert train(1, 2) == (4, (1, 2))


def test_other_exceptions_propagate_on_the_first_attempt() -> None:
    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=16)
    def train(batch_size: int) -> None:
        tried.append(batch_size)
        raise ValueError("bad data")

    with pytest.raises(ValueError, match="bad data"):
        train()
    assert tried == [16]


def test_non_oom_runtime_error_propagates_after_some_reductions() -> None:
    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=20)
    def train(batch_size: int) -> None:
        tried.append(batch_size)
        if batch_size > 16:
            raise _oom()
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        train()
    assert tried == [20, 18, 16]


def test_reaching_zero_raises() -> None:
    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=4)
    def train(batch_size: int) -> None:
        tried.append(batch_size)
        raise _oom()

    with pytest.raises(RuntimeError, match="No executable batch size found, reached zero."):
        train()
    assert tried == [4, 3, 2, 1]


def test_starting_at_zero_raises_when_called() -> None:
    @find_executable_batch_size(starting_batch_size=0)
    def train(batch_size: int) -> None:
        raise AssertionError("must not run")

    with pytest.raises(RuntimeError, match="reached zero"):
        train()


@pytest.mark.parametrize("bad", [-1, 2.5, "8", True])
def test_invalid_starting_batch_size_is_refused(bad: Any) -> None:
    expected = ValueError if bad == -1 else TypeError
    with pytest.raises(expected, match="starting_batch_size"):
        find_executable_batch_size(starting_batch_size=bad)


def test_reduce_batch_size_fn_receives_the_failed_batch_size() -> None:
    tried: list[int] = []
    seen: list[int] = []

    def halve(batch_size: int) -> int:
        seen.append(batch_size)
        return batch_size // 2

    @find_executable_batch_size(starting_batch_size=64, reduce_batch_size_fn=halve)
    def train(batch_size: int) -> int:
        tried.append(batch_size)
        if batch_size > 10:
            raise _oom()
        return batch_size

    assert train() == 8
    assert tried == [64, 32, 16, 8]
    assert seen == [64, 32, 16]


def test_reduce_batch_size_fn_without_arguments_accelerate_style() -> None:
    current = {"batch_size": 100}

    def minus_thirty() -> int:
        current["batch_size"] -= 30
        return current["batch_size"]

    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=100, reduce_batch_size_fn=minus_thirty)
    def train(batch_size: int) -> None:
        tried.append(batch_size)
        if batch_size > 50:
            raise _oom()

    train()
    assert tried == [100, 70, 40]


@pytest.mark.parametrize("result", [16, 20, -1, 7.5, None])
def test_reduce_batch_size_fn_must_shrink(result: Any) -> None:
    @find_executable_batch_size(starting_batch_size=16, reduce_batch_size_fn=lambda bs: result)
    def train(batch_size: int) -> None:
        raise _oom()

    with pytest.raises(ValueError, match="reduce_batch_size_fn"):
        train()


def test_cache_is_cleared_between_attempts(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []
    monkeypatch.setattr(
        memory, "clear_device_cache", lambda garbage_collection=False: calls.append(True)
    )

    @find_executable_batch_size(starting_batch_size=10)
    def train(batch_size: int) -> None:
        if batch_size > 8:
            raise _oom()

    train()
    # once before the first attempt, once after each of the two failures (10, 9)
    assert len(calls) == 3


def test_failed_attempt_memory_is_released_before_retrying() -> None:
    refs: list[weakref.ref[Any]] = []

    class Activations:
        def __init__(self) -> None:
            self.tensor = torch.zeros(8)
            self.cycle = self  # only the garbage collector can free it

    @find_executable_batch_size(starting_batch_size=3)
    def train(batch_size: int) -> None:
        if refs:
            assert refs[-1]() is None, "the previous attempt's objects are still alive"
        held = Activations()
        refs.append(weakref.ref(held))
        if batch_size > 1:
            raise _oom()

    train()
    assert len(refs) == 3


# --- release_memory / clear_device_cache --------------------------------------------------------


def test_release_memory_returns_nones_and_frees(monkeypatch: pytest.MonkeyPatch) -> None:
    class Holder:
        def __init__(self) -> None:
            self.weight = torch.ones(16, 16)

    cleared: list[bool] = []
    monkeypatch.setattr(
        memory, "clear_device_cache", lambda garbage_collection=False: cleared.append(True)
    )
    holder: Any = Holder()
    tensor: Any = torch.ones(4)
    ref = weakref.ref(holder)
    weight_ref = weakref.ref(holder.weight)
    tensor_ref = weakref.ref(tensor)

    holder, tensor = release_memory(holder, tensor)

    assert holder is None and tensor is None
    assert ref() is None
    assert weight_ref() is None
    assert tensor_ref() is None
    assert cleared == [True]


def test_release_memory_collects_cycles_left_by_earlier_work() -> None:
    class Cycle:
        def __init__(self) -> None:
            self.weight = torch.ones(8)
            self.myself = self

    ref = weakref.ref(Cycle())  # unreachable at once, but alive until a collection
    gc.disable()
    try:
        assert ref() is not None
        assert release_memory() == []
        assert ref() is None
    finally:
        gc.enable()


def test_release_memory_result_length() -> None:
    assert release_memory() == []
    assert release_memory(1, "a", None) == [None, None, None]


def test_public_names() -> None:
    assert sorted(memory.__all__) == [
        "clear_device_cache",
        "find_executable_batch_size",
        "release_memory",
        "should_reduce_batch_size",
    ]
