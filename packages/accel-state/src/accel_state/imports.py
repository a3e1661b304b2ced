"""Lazy probes for optional libraries and devices, and version comparisons.

Every ``is_<x>_available()`` answers without importing ``<x>``: it looks the module up with
:func:`importlib.util.find_spec` (and, where the distribution name differs, its metadata), so
importing accel never pulls in DeepSpeed, torch_xla, TensorBoard or other heavy libraries.
Device probes ask torch without initialising the device runtime where torch allows it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import operator
import os
from collections.abc import Callable
from typing import Any

import torch

from .environment import ACCEL_DISABLE_RICH, parse_flag_from_env

__all__ = [
    "compare_versions",
    "get_package_version",
    "is_aim_available",
    "is_bf16_available",
    "is_clearml_available",
    "is_comet_ml_available",
    "is_cuda_available",
    "is_datasets_available",
    "is_deepspeed_available",
    "is_dvclive_available",
    "is_mlflow_available",
    "is_mps_available",
    "is_mpi_available",
    "is_msamp_available",
    "is_npu_available",
    "is_numpy_available",
    "is_pandas_available",
    "is_peft_available",
    "is_rich_available",
    "is_safetensors_available",
    "is_swanlab_available",
    "is_tensorboard_available",
    "is_torch_version",
    "is_torch_xla_available",
    "is_torchao_available",
    "is_torchdata_available",
    "is_tqdm_available",
    "is_trackio_available",
    "is_transformer_engine_available",
    "is_transformers_available",
    "is_wandb_available",
    "is_xpu_available",
    "is_yaml_available",
]

_OPERATIONS: dict[str, Callable[[Any, Any], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
    "<=": operator.le,
    "<": operator.lt,
}


@functools.cache
def _is_package_available(module: str, distribution: str | None = None) -> bool:
    """True when ``module`` can be imported (and ``distribution`` is installed, if given)."""
    try:
        if importlib.util.find_spec(module) is None:
            return False
    except (ImportError, ValueError):
        return False
    if distribution is not None:
        try:
            importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            return False
    return True


def get_package_version(distribution: str) -> str | None:
    """Return the installed version of ``distribution``, or ``None`` when it is absent."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def compare_versions(
    library_or_version: str | Any, operation: str, requirement_version: str
) -> bool:
    """Compare a library's installed version (or a version) with ``requirement_version``.

    Args:
        library_or_version: A distribution name (``"torch"``) or a version (string or
            ``packaging.version.Version``).
        operation: One of ``>, >=, ==, !=, <=, <``.
        requirement_version: The version to compare with.

    Raises:
        ValueError: ``operation`` is not one of the six comparison operators.
        importlib.metadata.PackageNotFoundError: the library is not installed.
    """
    from packaging.version import Version, parse

    if operation not in _OPERATIONS:
        raise ValueError(
            f"operation={operation!r} is not supported: use one of {', '.join(_OPERATIONS)}"
        )
    if isinstance(library_or_version, str):
        try:
            current = Version(library_or_version)
        except ValueError:
            current = parse(importlib.metadata.version(library_or_version))
    else:
        current = library_or_version
    return _OPERATIONS[operation](current, parse(requirement_version))


def is_torch_version(operation: str, version: str) -> bool:
    """Compare the running torch version with ``version`` using ``operation``."""
    from packaging.version import parse

    return compare_versions(parse(parse(torch.__version__).base_version), operation, version)


def is_numpy_available() -> bool:
    """Whether numpy can be imported."""
    return _is_package_available("numpy")


def is_safetensors_available() -> bool:
    """Whether safetensors can be imported."""
    return _is_package_available("safetensors")


def is_yaml_available() -> bool:
    """Whether PyYAML can be imported."""
    return _is_package_available("yaml", "pyyaml")


def is_deepspeed_available() -> bool:
    """Whether DeepSpeed is installed (it is not imported)."""
    return _is_package_available("deepspeed", "deepspeed")


def is_torch_xla_available() -> bool:
    """Whether torch_xla is installed (it is not imported)."""
    return _is_package_available("torch_xla", "torch_xla")


def is_transformer_engine_available() -> bool:
    """Whether NVIDIA Transformer Engine is installed."""
    return _is_package_available("transformer_engine")


def is_msamp_available() -> bool:
    """Whether MS-AMP is installed."""
    return _is_package_available("msamp", "ms-amp")


def is_torchao_available() -> bool:
    """Whether torchao is installed."""
    return _is_package_available("torchao", "torchao")


def is_torchdata_available() -> bool:
    """Whether torchdata is installed."""
    return _is_package_available("torchdata")


def is_tensorboard_available() -> bool:
    """Whether TensorBoard (or tensorboardX) is installed."""
    return _is_package_available("tensorboard") or _is_package_available("tensorboardX")


def is_wandb_available() -> bool:
    """Whether Weights & Biases is installed."""
    return _is_package_available("wandb")


def is_comet_ml_available() -> bool:
    """Whether Comet ML is installed."""
    return _is_package_available("comet_ml")


def is_mlflow_available() -> bool:
    """Whether MLflow is installed."""
    return _is_package_available("mlflow")


def is_aim_available() -> bool:
    """Whether Aim is installed."""
    return _is_package_available("aim")


def is_clearml_available() -> bool:
    """Whether ClearML is installed."""
    return _is_package_available("clearml")


def is_dvclive_available() -> bool:
    """Whether DVCLive is installed."""
    return _is_package_available("dvclive")


def is_swanlab_available() -> bool:
    """Whether SwanLab is installed."""
    return _is_package_available("swanlab")


def is_trackio_available() -> bool:
    """Whether Trackio is installed."""
    return _is_package_available("trackio")


def is_rich_available() -> bool:
    """Whether rich is installed and not disabled with ``ACCEL_DISABLE_RICH``."""
    return _is_package_available("rich") and not parse_flag_from_env(ACCEL_DISABLE_RICH)


def is_tqdm_available() -> bool:
    """Whether tqdm is installed."""
    return _is_package_available("tqdm")


def is_pandas_available() -> bool:
    """Whether pandas is installed."""
    return _is_package_available("pandas")


def is_datasets_available() -> bool:
    """Whether Hugging Face datasets is installed."""
    return _is_package_available("datasets")


def is_transformers_available() -> bool:
    """Whether Hugging Face transformers is installed."""
    return _is_package_available("transformers")


def is_peft_available() -> bool:
    """Whether PEFT is installed."""
    return _is_package_available("peft")


def is_mpi_available() -> bool:
    """Whether torch was built with the MPI backend."""
    return bool(torch.distributed.is_available() and torch.distributed.is_mpi_available())


def is_cuda_available() -> bool:
    """Whether a CUDA device is usable, asked through NVML so CUDA is not initialised."""
    saved = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        return bool(torch.cuda.is_available())
    finally:
        if saved is None:
            os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = saved


def is_xpu_available() -> bool:
    """Whether an Intel XPU device is usable."""
    xpu = getattr(torch, "xpu", None)
    return bool(xpu is not None and xpu.is_available())


def is_mps_available() -> bool:
    """Whether Apple's MPS device is usable."""
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available() and backend.is_built())


def is_npu_available() -> bool:
    """Whether an Ascend NPU (torch_npu) is installed and usable."""
    if not _is_package_available("torch_npu"):
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Whether bf16 compute is supported on the default accelerator (always on CPU)."""
    if is_cuda_available():
        return bool(torch.cuda.is_bf16_supported())
    if is_xpu_available():
        return True
    if is_mps_available():
        return is_torch_version(">=", "2.5")
    return True
