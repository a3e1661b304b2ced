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
import sys
from collections.abc import Callable
from typing import Any

import torch

from .environment import ACCEL_DISABLE_RICH, parse_flag_from_env

__all__ = [
    "are_libraries_initialized",
    "compare_versions",
    "deepspeed_required",
    "get_package_version",
    "is_4bit_bnb_available",
    "is_8bit_bnb_available",
    "is_aim_available",
    "is_amdsmi_available",
    "is_bf16_available",
    "is_bitsandbytes_multi_backend_available",
    "is_bnb_available",
    "is_boto3_available",
    "is_clearml_available",
    "is_comet_ml_available",
    "is_cuda_available",
    "is_datasets_available",
    "is_deepspeed_available",
    "is_dvclive_available",
    "is_fp16_available",
    "is_fp8_available",
    "is_habana_gaudi1",
    "is_hpu_available",
    "is_import_timer_available",
    "is_lomo_available",
    "is_matplotlib_available",
    "is_megatron_lm_available",
    "is_mlflow_available",
    "is_mlu_available",
    "is_mpi_available",
    "is_mps_available",
    "is_msamp_available",
    "is_musa_available",
    "is_neuron_available",
    "is_npu_available",
    "is_numpy_available",
    "is_pandas_available",
    "is_peft_available",
    "is_pippy_available",
    "is_pynvml_available",
    "is_pytest_available",
    "is_rich_available",
    "is_rocm_available",
    "is_safetensors_available",
    "is_sagemaker_available",
    "is_schedulefree_available",
    "is_sdaa_available",
    "is_swanlab_available",
    "is_tensorboard_available",
    "is_timm_available",
    "is_torch_distributed_available",
    "is_torch_version",
    "is_torch_xla_available",
    "is_torchao_available",
    "is_torchdata_available",
    "is_torchdata_stateful_dataloader_available",
    "is_torchvision_available",
    "is_tqdm_available",
    "is_trackio_available",
    "is_transformer_engine_available",
    "is_transformer_engine_mxfp8_available",
    "is_transformers_available",
    "is_triton_available",
    "is_wandb_available",
    "is_weights_only_available",
    "is_xccl_available",
    "is_xpu_available",
    "is_yaml_available",
    "torchao_required",
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
def is_package_available(module: str, distribution: str | None = None) -> bool:
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


def is_numpy_available(min_version: str | None = None) -> bool:
    """Whether numpy can be imported (at ``min_version`` or newer, when given)."""
    if not is_package_available("numpy"):
        return False
    return min_version is None or _at_least("numpy", min_version)


def _at_least(distribution: str, version: str) -> bool:
    installed = get_package_version(distribution)
    return installed is not None and compare_versions(installed, ">=", version)


def is_safetensors_available() -> bool:
    """Whether safetensors can be imported."""
    return is_package_available("safetensors")


def is_yaml_available() -> bool:
    """Whether PyYAML can be imported."""
    return is_package_available("yaml", "pyyaml")


def is_deepspeed_available() -> bool:
    """Whether DeepSpeed is installed (it is not imported)."""
    return is_package_available("deepspeed", "deepspeed")


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """Whether torch_xla is installed; with a check, whether its device is a TPU or a GPU.

    Without a check torch_xla is not imported; ``USE_TORCH_XLA=false`` hides it, as in
    Accelerate.

    Raises:
        ValueError: both checks were asked for.
    """
    if check_is_tpu and check_is_gpu:
        raise ValueError("is_torch_xla_available: pass check_is_tpu or check_is_gpu, not both")
    if os.environ.get("USE_TORCH_XLA", "true").strip().lower() in ("0", "false", "no", "off"):
        return False
    if not is_package_available("torch_xla", "torch_xla"):
        return False
    if not (check_is_tpu or check_is_gpu):
        return True
    import torch_xla.runtime as xr  # the device type needs the runtime

    kind = str(xr.device_type())
    return kind == "TPU" if check_is_tpu else kind in ("GPU", "CUDA")


def is_transformer_engine_available() -> bool:
    """Whether NVIDIA Transformer Engine is installed."""
    return is_package_available("transformer_engine")


def is_msamp_available() -> bool:
    """Whether MS-AMP is installed."""
    return is_package_available("msamp", "ms-amp")


def is_torchao_available() -> bool:
    """Whether torchao is installed."""
    return is_package_available("torchao", "torchao")


def is_torchdata_available() -> bool:
    """Whether torchdata is installed."""
    return is_package_available("torchdata")


def is_tensorboard_available() -> bool:
    """Whether TensorBoard (or tensorboardX) is installed."""
    return is_package_available("tensorboard") or is_package_available("tensorboardX")


def is_wandb_available() -> bool:
    """Whether Weights & Biases is installed."""
    return is_package_available("wandb")


def is_comet_ml_available() -> bool:
    """Whether Comet ML is installed."""
    return is_package_available("comet_ml")


def is_mlflow_available() -> bool:
    """Whether MLflow is installed."""
    return is_package_available("mlflow")


def is_aim_available() -> bool:
    """Whether Aim is installed."""
    return is_package_available("aim")


def is_clearml_available() -> bool:
    """Whether ClearML is installed."""
    return is_package_available("clearml")


def is_dvclive_available() -> bool:
    """Whether DVCLive is installed."""
    return is_package_available("dvclive")


def is_swanlab_available() -> bool:
    """Whether SwanLab is installed."""
    return is_package_available("swanlab")


def is_trackio_available() -> bool:
    """Whether Trackio is installed."""
    return is_package_available("trackio")


def is_rich_available() -> bool:
    """Whether rich is installed and not disabled with ``ACCEL_DISABLE_RICH``."""
    return is_package_available("rich") and not parse_flag_from_env(ACCEL_DISABLE_RICH)


def is_tqdm_available() -> bool:
    """Whether tqdm is installed."""
    return is_package_available("tqdm")


def is_pandas_available() -> bool:
    """Whether pandas is installed."""
    return is_package_available("pandas")


def is_datasets_available() -> bool:
    """Whether Hugging Face datasets is installed."""
    return is_package_available("datasets")


def is_transformers_available() -> bool:
    """Whether Hugging Face transformers is installed."""
    return is_package_available("transformers")


def is_peft_available() -> bool:
    """Whether PEFT is installed."""
    return is_package_available("peft")


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


def is_xpu_available(check_device: bool = False) -> bool:
    """Whether an Intel XPU device is usable (``check_device`` is accepted for Accelerate)."""
    xpu = getattr(torch, "xpu", None)
    return bool(xpu is not None and xpu.is_available())


def is_mps_available(min_version: str = "1.12") -> bool:
    """Whether Apple's MPS device is usable with torch >= ``min_version``."""
    if not is_torch_version(">=", min_version):
        return False
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available() and backend.is_built())


def is_npu_available(check_device: bool = False) -> bool:
    """Whether an Ascend NPU (torch_npu) is installed and usable."""
    if not is_package_available("torch_npu"):
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


def _device_module_available(package: str, attribute: str) -> bool:
    """Whether ``package`` (a torch device plug-in) is installed and ``torch.<attribute>`` works."""
    if not is_package_available(package):
        return False
    importlib.import_module(package)  # the plug-in registers torch.<attribute>
    module = getattr(torch, attribute, None)
    return bool(module is not None and module.is_available())


def is_mlu_available(check_device: bool = False) -> bool:
    """Whether a Cambricon MLU (torch_mlu) is installed and usable."""
    return _device_module_available("torch_mlu", "mlu")


def is_musa_available(check_device: bool = False) -> bool:
    """Whether a Moore Threads MUSA device (torch_musa) is installed and usable."""
    return _device_module_available("torch_musa", "musa")


def is_sdaa_available(check_device: bool = False) -> bool:
    """Whether a Tecorigin SDAA device (torch_sdaa) is installed and usable."""
    return _device_module_available("torch_sdaa", "sdaa")


def is_neuron_available(check_device: bool = False) -> bool:
    """Whether an AWS Neuron device (torch_neuronx) is installed and usable."""
    return _device_module_available("torch_neuronx", "neuron")


def is_hpu_available(init_hccl: bool = False) -> bool:
    """Whether an Intel Gaudi HPU (habana_frameworks) is installed and usable."""
    if not is_package_available("habana_frameworks"):
        return False
    try:
        if importlib.util.find_spec("habana_frameworks.torch") is None:
            return False
    except (ImportError, ValueError):
        return False
    importlib.import_module("habana_frameworks.torch")
    if init_hccl:
        importlib.import_module("habana_frameworks.torch.distributed.hccl")
    hpu = getattr(torch, "hpu", None)
    return bool(hpu is not None and hpu.is_available())


def is_habana_gaudi1() -> bool:
    """Whether the HPU is a first-generation Gaudi (no fp16, no fp8)."""
    if not is_hpu_available():
        return False
    experimental = importlib.import_module("habana_frameworks.torch.utils.experimental")
    return bool(experimental._get_device_type() == experimental.synDeviceType.synDeviceGaudi)


def is_rocm_available() -> bool:
    """Whether torch is a ROCm build with a usable device."""
    return torch.version.hip is not None and torch.cuda.is_available()


def is_torch_distributed_available() -> bool:
    """Whether torch was built with torch.distributed."""
    return bool(torch.distributed.is_available())


def is_xccl_available() -> bool:
    """Whether torch has the XCCL backend (Intel XPU collectives; torch >= 2.7)."""
    if not is_torch_version(">=", "2.7.0") or not is_torch_distributed_available():
        return False
    return bool(torch.distributed.distributed_c10d.is_xccl_available())


def is_fp16_available() -> bool:
    """Whether fp16 compute is supported (not on a first-generation Gaudi)."""
    return not is_habana_gaudi1()


def is_fp8_available() -> bool:
    """Whether an FP8 library is installed (torchao, Transformer Engine or MS-AMP)."""
    return is_torchao_available() or is_transformer_engine_available() or is_msamp_available()


def is_transformer_engine_mxfp8_available() -> bool:
    """Whether Transformer Engine is installed and the device supports MXFP8 block scaling."""
    if not is_package_available("transformer_engine"):
        return False
    fp8 = importlib.import_module("transformer_engine.pytorch.fp8")
    return bool(fp8.check_mxfp8_support()[0])


def is_bnb_available(min_version: str | None = None) -> bool:
    """Whether bitsandbytes is installed (at ``min_version`` or newer, when given)."""
    if not is_package_available("bitsandbytes"):
        return False
    return min_version is None or _at_least("bitsandbytes", min_version)


def is_4bit_bnb_available() -> bool:
    """Whether bitsandbytes >= 0.39 (4-bit quantisation) is installed."""
    return is_bnb_available("0.39.0")


def is_8bit_bnb_available() -> bool:
    """Whether bitsandbytes >= 0.37.2 (8-bit quantisation) is installed."""
    return is_bnb_available("0.37.2")


def is_bitsandbytes_multi_backend_available() -> bool:
    """Whether the installed bitsandbytes has its multi-backend feature."""
    if not is_bnb_available():
        return False
    return "multi_backend" in getattr(importlib.import_module("bitsandbytes"), "features", set())


def is_torchdata_stateful_dataloader_available() -> bool:
    """Whether torchdata >= 0.8 (``StatefulDataLoader``) is installed."""
    return is_torchdata_available() and _at_least("torchdata", "0.8.0")


def is_megatron_lm_available() -> bool:
    """Whether Megatron-LM (megatron-core >= 0.8 with megatron.training) is installed and asked for.

    accel refuses the Megatron-LM engine whatever this says; the probe is kept for scripts
    that branch on it.
    """
    from .environment import ACCEL_USE_MEGATRON_LM

    if not parse_flag_from_env(ACCEL_USE_MEGATRON_LM):
        return False
    if not is_package_available("megatron") or not _at_least("megatron-core", "0.8.0"):
        return False
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except (ImportError, ValueError):
        return False


def is_pippy_available() -> bool:
    """Whether torch has pipeline parallelism (``torch.distributed.pipelining``, torch >= 2.4)."""
    return is_torch_version(">=", "2.4.0")


def is_weights_only_available() -> bool:
    """Whether ``torch.load(weights_only=True)`` takes an allowlist (torch >= 2.4)."""
    return is_torch_version(">=", "2.4.0")


def are_libraries_initialized(*library_names: str) -> list[str]:
    """The names among ``library_names`` that are already imported in this interpreter."""
    return [name for name in library_names if name in sys.modules]


def _require(probe: Callable[[], bool], what: str, install: str) -> Callable[[Any], Any]:
    def decorator(func: Any) -> Any:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not probe():
                raise ImportError(f"{func.__name__} needs {what}: pip install {install}")
            return func(*args, **kwargs)

        return wrapper

    decorator.__doc__ = (
        f"Decorate a function so that calling it raises ``ImportError`` when {what} is not "
        f"installed, naming the install command (``pip install {install}``)."
    )
    return decorator


# Decorators that refuse a call, with the install command, when the library is missing.
deepspeed_required = _require(is_deepspeed_available, "DeepSpeed", '"accel[deepspeed]"')
torchao_required = _require(is_torchao_available, "torchao", '"accel-amp[fp8]"')


def _package_probe(name: str, module: str, what: str) -> Callable[[], bool]:
    def probe() -> bool:
        return is_package_available(module)

    probe.__name__ = probe.__qualname__ = f"is_{name}_available"
    probe.__doc__ = f"Whether {what} is installed."
    return probe


is_pytest_available = _package_probe("pytest", "pytest", "pytest")
is_schedulefree_available = _package_probe("schedulefree", "schedulefree", "schedulefree")
is_lomo_available = _package_probe("lomo", "lomo_optim", "LOMO (lomo_optim)")
is_import_timer_available = _package_probe("import_timer", "import_timer", "import_timer (tuna)")
is_pynvml_available = _package_probe("pynvml", "pynvml", "pynvml / nvidia-ml-py")
is_amdsmi_available = _package_probe("amdsmi", "amdsmi", "amdsmi")
is_torchvision_available = _package_probe("torchvision", "torchvision", "torchvision")
is_timm_available = _package_probe("timm", "timm", "timm")
is_triton_available = _package_probe("triton", "triton", "triton")
is_boto3_available = _package_probe("boto3", "boto3", "boto3")
is_sagemaker_available = _package_probe("sagemaker", "sagemaker", "the SageMaker SDK")
is_matplotlib_available = _package_probe("matplotlib", "matplotlib", "matplotlib")
