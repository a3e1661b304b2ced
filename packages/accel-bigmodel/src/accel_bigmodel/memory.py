"""Memory budgets for the device-map planner: what each device can hold.

:func:`get_max_memory` reads the free memory of every accelerator and the available RAM, or
validates a budget written by a user (``{0: "10GiB", "cpu": "30GB"}``) into bytes in the order
the planner fills devices: accelerators by index, then ``"mps"``, ``"cpu"`` and ``"disk"``.
:func:`get_balanced_memory` turns a budget into one that spreads a model evenly over the GPUs
(``device_map="balanced"``), optionally keeping GPU 0 nearly free (``"balanced_low_0"``).
Results are the same as Accelerate 1.15's for the same inputs; the input dict is never changed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch import nn

from accel_state.imports import is_mps_available, is_npu_available, is_xpu_available

from .sizes import DtypeLike, compute_module_sizes, convert_file_size_to_int

__all__ = ["MaxMemory", "get_balanced_memory", "get_max_memory"]

logger = logging.getLogger(__name__)

MaxMemory = Mapping[Any, int | float | str]
"""A memory budget: ``{accelerator index or "mps"/"cpu"/"disk": bytes or "10GiB"}``."""

_NAMED_DEVICES = ("mps", "cpu", "disk")

_KEY_FORMS = (
    "integers for accelerator indexes (GPU/XPU/NPU 0, 1, ...), 'mps', 'cpu' and 'disk' "
    "(for example {0: '10GiB', 'cpu': '30GB'})"
)


def _accelerator_backend() -> tuple[str, Any]:
    """The accelerator kind integer keys refer to, and its ``torch`` submodule."""
    if is_npu_available():
        return "npu", getattr(torch, "npu")  # noqa: B009 - only exists with torch_npu
    if is_xpu_available():
        return "xpu", torch.xpu
    return "cuda", torch.cuda


def _touch_device(device: torch.device) -> None:
    """Create a tiny tensor on ``device`` so its context exists and its memory info is real."""
    torch.tensor([0], device=device)


def _measure_free_memory() -> dict[int | str, int | float | str]:
    """Free bytes of every usable accelerator plus the available RAM (or MPS's shared RAM)."""
    kind, backend = _accelerator_backend()
    budget: dict[int | str, int | float | str] = {}
    shares_host_memory = False
    for index in range(backend.device_count()):
        try:
            _touch_device(torch.device(kind, index))
            budget[index] = int(backend.mem_get_info(index)[0])
            if kind == "cuda":
                properties = torch.cuda.get_device_properties(index)
                shares_host_memory = shares_host_memory or bool(
                    getattr(properties, "is_integrated", False)
                )
        except Exception as error:  # noqa: BLE001 - a broken device is skipped, not fatal
            logger.info("%s device %d seems unavailable (%s); skipping it.", kind, index, error)
    # psutil costs ~85 ms to import: loaded when memory is first measured, not with the package.
    import psutil

    available = psutil.virtual_memory().available
    # MPS and integrated GPUs use host RAM: a separate CPU budget would count it twice.
    if is_mps_available():
        budget["mps"] = available
    elif not shares_host_memory:
        budget["cpu"] = available
    return budget


def get_max_memory(max_memory: MaxMemory | None = None) -> dict[int | str, Any]:
    """The memory budget of each device, in bytes, in the order the planner fills them.

    With no budget, every usable accelerator gets its current free memory and ``"cpu"`` the
    available RAM (on Apple silicon ``"mps"`` gets the RAM and there is no ``"cpu"`` entry).
    A given budget has its size strings converted to bytes and is reordered: accelerator
    indexes ascending, then ``"mps"``, ``"cpu"``, ``"disk"``. Indexes of devices this machine
    does not have are kept (plans can be made for another machine) with a warning.

    As in Accelerate, the size strings of the caller's dict are replaced by their byte counts
    (transformers' ``from_pretrained`` compares its values with numbers afterwards); nothing is
    changed when a key or a value is refused.

    Args:
        max_memory: ``{0: "10GiB", 1: 8_000_000_000, "cpu": "30GB", "disk": "1TB"}``.

    Returns:
        A new dict from device to bytes.

    Raises:
        ValueError: a key is not an accelerator index (>= 0), ``"mps"``, ``"cpu"`` or
            ``"disk"``, a size string is not valid, or a number is negative or NaN.
        TypeError: a value is neither a number nor a size string.
    """
    if max_memory is None:
        return _measure_free_memory()
    if not isinstance(max_memory, Mapping):
        raise TypeError(
            f"max_memory={max_memory!r} has type {type(max_memory).__name__}: use a dict from "
            f"device to size with {_KEY_FORMS}."
        )

    converted: dict[int | str, Any] = {}
    for key, value in max_memory.items():
        is_index = isinstance(key, int) and not isinstance(key, bool)
        if not is_index and key not in _NAMED_DEVICES:
            raise ValueError(
                f"max_memory has the key {key!r}, which is not a device the planner knows: use "
                f"{_KEY_FORMS}."
            )
        if is_index and key < 0:
            raise ValueError(
                f"max_memory has the key {key!r}, a negative accelerator index: use {_KEY_FORMS}."
            )
        converted[key] = _budget_value(key, value)
    if isinstance(max_memory, MutableMapping):
        for key, value in converted.items():
            if isinstance(max_memory[key], str):
                max_memory[key] = value

    indexes = sorted(key for key in converted if isinstance(key, int))
    _, backend = _accelerator_backend()
    available = backend.device_count()
    for index in indexes:
        if not 0 <= index < available:
            logger.warning(
                "max_memory has device %d, which this machine does not have (available "
                "devices: %s); planning for it anyway.",
                index,
                list(range(available)),
            )
    order: list[int | str] = [*indexes, *(name for name in _NAMED_DEVICES if name in converted)]
    return {key: converted[key] for key in order}


def _budget_value(key: int | str, value: Any) -> Any:
    """One budget value as bytes: size strings are converted, numbers pass through."""
    if isinstance(value, str):
        try:
            return convert_file_size_to_int(value)
        except ValueError as error:
            raise ValueError(f"max_memory[{key!r}]: {error}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"max_memory[{key!r}]={value!r} has type {type(value).__name__}: use a number of "
            "bytes or a size string such as '10GiB' or '500MB'."
        )
    if math.isnan(value) or value < 0:
        raise ValueError(
            f"max_memory[{key!r}]={value!r} is not a size: use a number of bytes >= 0 or a "
            "size string such as '10GiB' or '500MB' (0 keeps the device empty)."
        )
    return value


def _expected_device_type() -> str:
    """The device type whose named keys count as accelerators when balancing."""
    if is_npu_available():
        return "npu"
    if is_xpu_available():
        return "xpu"
    if is_mps_available():
        return "mps"
    return "cuda"


def _module_leaves(names: Sequence[str]) -> list[str]:
    """Names (other than ``""``) that no other name in ``names`` has as its direct parent."""
    parents = {name.rsplit(".", 1)[0] for name in names if "." in name}
    return [name for name in names if name and name not in parents]


def normalise_no_split(no_split_module_classes: Sequence[str] | str | None) -> list[str]:
    if no_split_module_classes is None:
        return []
    if isinstance(no_split_module_classes, str):
        return [no_split_module_classes]
    return list(no_split_module_classes)


def get_balanced_memory(
    model: nn.Module,
    max_memory: MaxMemory | None = None,
    no_split_module_classes: Sequence[str] | str | None = None,
    dtype: DtypeLike | None = None,
    special_dtypes: Mapping[str, DtypeLike] | None = None,
    low_zero: bool = False,
) -> dict[int | str, Any]:
    """A budget for :func:`infer_auto_device_map` that spreads ``model`` evenly over the GPUs.

    Each GPU but the last is capped at ``model size / number of GPUs`` plus a margin (1.25
    times the larger of the first no-split block's size and the mean size of the last-level
    modules), so the greedy planner does not fill GPU 0 first; the last GPU keeps its whole
    budget in case the margin was not enough. With one GPU and no budget given, 90% of its
    free memory is used, leaving room for activations. Sizes come from shapes and dtypes, so
    the model may be on the meta device.

    Args:
        model: the model to place.
        max_memory: the budget to balance (see :func:`get_max_memory`); measured when ``None``.
        no_split_module_classes: class names of modules that must stay on one device.
        dtype: the dtype the weights will be loaded in.
        special_dtypes: dtypes of particular tensors, by full name.
        low_zero: give GPU 0 only what the other GPUs cannot hold (useful when GPU 0 also runs
            generation); ignored with a single GPU.

    Returns:
        A new budget dict (GPUs without memory and the CPU/disk entries are left as they are).

    Raises:
        ValueError: a bad budget (see :func:`get_max_memory`), or ``low_zero=True`` with a
            budget that has no GPU 0.
    """
    measured = max_memory is None
    budget = get_max_memory(max_memory)
    expected = _expected_device_type()
    accelerators = [
        key
        for key, value in budget.items()
        if (isinstance(key, int) or key == expected) and value > 0
    ]
    count = len(accelerators)
    if count == 0:
        return budget
    if count == 1:
        low_zero = False
        if measured:
            first_index = next((key for key in budget if isinstance(key, int)), None)
            if first_index is not None:
                budget[first_index] *= 0.9
                logger.info(
                    "Using 90%% of the memory of device %s for the model and keeping 10%% for "
                    "activations; pass max_memory to use more (at the risk of running out).",
                    first_index,
                )
    if low_zero and 0 not in budget:
        raise ValueError(
            f"low_zero=True keeps GPU 0 for generation, but max_memory has no GPU 0 "
            f"(keys: {list(budget)}): add 0 to max_memory or pass low_zero=False."
        )

    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    total = sizes[""]
    per_gpu = total // (count - 1 if low_zero else count)

    no_split = normalise_no_split(no_split_module_classes)
    first_block_sizes: dict[str, Any] = {}
    if no_split:
        wanted = set(no_split)
        for name, size in sizes.items():
            if not name:
                continue
            class_name = type(_resolve(model, name)).__name__
            if class_name in wanted and class_name not in first_block_sizes:
                first_block_sizes[class_name] = size
                if set(first_block_sizes) == wanted:
                    break
    block_margin = max(first_block_sizes.values()) if first_block_sizes else 0

    # Drop the tensors (the leaves of the size tree); the leaves left are the last-level modules.
    tensor_names = set(_module_leaves(list(sizes)))
    module_sizes = {name: size for name, size in sizes.items() if name not in tensor_names}
    last_level = _module_leaves(list(module_sizes))
    mean_last_level = int(sum(module_sizes[name] for name in last_level) / max(len(last_level), 1))
    per_gpu += int(1.25 * max(block_margin, mean_last_level))

    gpu_indexes = sorted(key for key, value in budget.items() if isinstance(key, int) and value > 0)
    for index in gpu_indexes[:-1]:
        if low_zero and index == 0:
            continue
        budget[index] = min(per_gpu, budget[index])

    if low_zero:
        # GPUs 1..count-1 take what they can; with gaps in the indexes, every other GPU does.
        others = list(range(1, count))
        if not all(index in budget for index in others):
            others = [index for index in gpu_indexes if index != 0]
        held = sum(budget[index] for index in others)
        budget[0] = min(max(0, total - held), budget[0])
    return budget


def _resolve(model: nn.Module, name: str) -> Any:
    """The submodule, parameter or buffer of ``model`` at the dotted ``name``."""
    target: Any = model
    for part in name.split("."):
        target = getattr(target, part)
    return target
