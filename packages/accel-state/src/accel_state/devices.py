"""Device discovery: which accelerator this process uses and which backend goes with it.

The preference order is CUDA > XPU > MPS > CPU (NPU, when ``torch_npu`` is installed, comes
after XPU). ``ACCEL_TORCH_DEVICE`` overrides the choice; ``cpu=True`` (or ``ACCEL_USE_CPU``)
forces the CPU.
"""

from __future__ import annotations

import gc
import os

import torch

from .imports import is_cuda_available, is_mps_available, is_npu_available, is_xpu_available

__all__ = [
    "backend_for_device_type",
    "check_cuda_fp8_capability",
    "check_cuda_p2p_ib_support",
    "clear_device_cache",
    "default_device_type",
    "device_count",
    "get_current_device_type",
    "get_driver_version",
    "get_gpu_info",
    "override_numa_affinity",
    "parse_cpu_list",
    "parse_device",
    "pin_to_numa_node_of",
    "set_device",
    "set_numa_affinity",
]

#: The process-group backend each device type uses by default.
_DEFAULT_BACKENDS: dict[str, str] = {
    "cuda": "nccl",
    "xpu": "xccl",
    "npu": "hccl",
    "cpu": "gloo",
}

#: Backends a device type can run; anything else is refused with a clear error.
_COMPATIBLE_BACKENDS: dict[str, tuple[str, ...]] = {
    "cuda": ("nccl", "gloo", "mpi", "cuda:nccl,cpu:gloo"),
    "xpu": ("xccl", "ccl", "gloo"),
    "npu": ("hccl",),
    "cpu": ("gloo", "mpi", "ccl"),
}


def default_device_type() -> str:
    """Return the best available device type: ``cuda``, ``xpu``, ``npu``, ``mps`` or ``cpu``."""
    if is_cuda_available():
        return "cuda"
    if is_xpu_available():
        return "xpu"
    if is_npu_available():
        return "npu"
    if is_mps_available():
        return "mps"
    return "cpu"


def device_count(device_type: str) -> int:
    """Number of devices of ``device_type`` visible to this process (1 for cpu and mps)."""
    if device_type in ("cpu", "mps"):
        return 1
    module = getattr(torch, device_type, None)
    if module is None or not hasattr(module, "device_count"):
        return 0
    return int(module.device_count())


def backend_for_device_type(device_type: str, requested: str | None = None) -> str:
    """Choose the process-group backend for ``device_type``.

    Args:
        device_type: ``cuda``, ``xpu``, ``npu`` or ``cpu``.
        requested: A backend asked for explicitly (``InitProcessGroupKwargs(backend=...)``).

    Raises:
        ValueError: the device type cannot run several processes, or ``requested`` does not
            work with it.
    """
    if device_type not in _DEFAULT_BACKENDS:
        raise ValueError(
            f"several processes on device type {device_type!r} are not supported by "
            "torch.distributed: pass cpu=True (or set ACCEL_USE_CPU=1) to train on the CPU"
        )
    if requested is None:
        if device_type == "xpu" and not _xccl_available():
            return "ccl"
        return _DEFAULT_BACKENDS[device_type]
    allowed = _COMPATIBLE_BACKENDS[device_type]
    if requested not in allowed:
        raise ValueError(
            f"backend={requested!r} cannot run on device type {device_type!r}: use one of "
            f"{', '.join(repr(b) for b in allowed)} (or leave backend unset to get "
            f"{_DEFAULT_BACKENDS[device_type]!r})"
        )
    return requested


def _xccl_available() -> bool:
    checker = getattr(torch.distributed, "is_xccl_available", None)
    return bool(checker is not None and checker())


def parse_device(value: str, source: str = "ACCEL_TORCH_DEVICE") -> torch.device:
    """Parse a device string such as ``"cpu"`` or ``"cuda:1"``.

    Raises:
        ValueError: ``value`` is not a device torch understands (the message names ``source``).
    """
    try:
        return torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"{source}={value!r} is not a torch device: use a string such as 'cpu', 'cuda', "
            "'cuda:1', 'xpu:0' or 'mps'"
        ) from None


def parse_cpu_list(text: str) -> set[int]:
    """Parse a Linux CPU list such as ``"0-3,8,10-11"`` into a set of CPU indices.

    Raises:
        ValueError: the text is not a CPU list.
    """
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        try:
            low, high = int(first), int(last or first)
        except ValueError:
            raise ValueError(f"{text!r} is not a CPU list such as '0-3,8'") from None
        cpus.update(range(low, high + 1))
    return cpus


def pin_to_numa_node_of(device: torch.device) -> set[int] | None:
    """Restrict this process to the CPUs attached to the NUMA node of CUDA ``device``.

    Used when ``ACCEL_CPU_AFFINITY`` is set: data-loading workers and host copies then stay
    on memory close to the GPU. Returns the CPUs chosen, or ``None`` (with a warning) when
    torch or the system does not tell where the device sits.
    """
    import warnings

    if device.type != "cuda" or not hasattr(os, "sched_setaffinity"):
        return None
    props = torch.cuda.get_device_properties(device)
    ids = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if any(value is None for value in ids):
        warnings.warn(
            "ACCEL_CPU_AFFINITY is set but this torch build does not report the GPU's PCI "
            "address; CPU affinity left unchanged",
            stacklevel=2,
        )
        return None
    domain, bus, slot = ids
    path = f"/sys/bus/pci/devices/{domain:04x}:{bus:02x}:{slot:02x}.0/local_cpulist"
    try:
        with open(path, encoding="ascii") as stream:
            cpus = parse_cpu_list(stream.read())
    except OSError as err:
        warnings.warn(
            f"ACCEL_CPU_AFFINITY: cannot read {path} ({err}); affinity left unchanged", stacklevel=2
        )
        return None
    os.sched_setaffinity(0, cpus)
    return cpus


def set_device(device: torch.device) -> None:
    """Make ``device`` the current device of its backend (no-op for cpu and mps)."""
    if device.type in ("cpu", "mps", "meta"):
        return
    module = getattr(torch, device.type, None)
    if module is not None and hasattr(module, "set_device"):
        module.set_device(device)


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Hand the cached, unused memory of the available accelerators back to the driver.

    Empties the caching allocator of CUDA, XPU, NPU and MPS, each only when that device is
    available (CUDA only once it is initialised); on a CPU-only machine only the optional
    garbage collection happens. Tensors still referenced are not freed: drop them first.

    Args:
        garbage_collection: Run :func:`gc.collect` first, so that tensors kept alive only by
            reference cycles are released before the cache is emptied.
    """
    if garbage_collection:
        gc.collect()
    if is_cuda_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    if is_xpu_available() and hasattr(torch.xpu, "empty_cache"):
        torch.xpu.empty_cache()
    if is_npu_available():
        npu = getattr(torch, "npu", None)
        if npu is not None and hasattr(npu, "empty_cache"):
            npu.empty_cache()
    if is_mps_available():
        torch.mps.empty_cache()


# --- Accelerate's hardware helpers (accelerate.utils.environment) --------------------------

#: The distributed type of several processes on each device type.
_MULTI_TYPES = {
    "cuda": "MULTI_GPU",
    "xpu": "MULTI_XPU",
    "npu": "MULTI_NPU",
    "mlu": "MULTI_MLU",
    "sdaa": "MULTI_SDAA",
    "musa": "MULTI_MUSA",
    "hpu": "MULTI_HPU",
    "neuron": "MULTI_NEURON",
}


def get_current_device_type() -> tuple[str, str]:
    """``(device type, distributed type)`` of this machine, without initialising the device.

    For example ``("cuda", "MULTI_GPU")``; ``("cpu", "MULTI_CPU")`` on a machine without an
    accelerator (``mps`` counts as one device, ``("mps", "NO")``).
    """
    kind = default_device_type()
    if kind == "mps":
        return kind, "NO"
    return kind, _MULTI_TYPES.get(kind, "MULTI_CPU")


def _nvidia_smi(*query: str) -> list[str]:
    """Lines of ``nvidia-smi --query-gpu=<query> --format=csv,noheader`` (CUDA not initialised).

    Raises:
        FileNotFoundError: nvidia-smi is not installed.
    """
    import shutil
    import subprocess

    program = shutil.which("nvidia-smi")
    if program is None:
        raise FileNotFoundError("nvidia-smi is not on PATH: no NVIDIA driver on this machine")
    output = subprocess.check_output(
        [program, f"--query-gpu={','.join(query)}", "--format=csv,noheader"], text=True
    )
    return [line.strip() for line in output.strip().splitlines() if line.strip()]


def get_gpu_info() -> tuple[list[str], int]:
    """The names and the number of NVIDIA GPUs, from nvidia-smi (CUDA is not initialised)."""
    names = [line.split(",", 1)[-1].strip() for line in _nvidia_smi("count", "name")]
    return names, len(names)


def get_driver_version() -> str:
    """The NVIDIA driver version (of the first GPU), from nvidia-smi."""
    return _nvidia_smi("driver_version")[0]


def check_cuda_p2p_ib_support() -> bool:
    """False on machines whose consumer GPUs (RTX 40xx) need NCCL's P2P/IB turned off.

    With several such GPUs and a driver older than 550.40.07, NCCL's peer-to-peer and
    InfiniBand paths hang; True everywhere else (and when nvidia-smi cannot tell).
    """
    from packaging.version import parse

    try:
        names, count = get_gpu_info()
        if count > 1 and any("RTX 40" in name for name in names):
            return parse(get_driver_version()) >= parse("550.40.07")
    except (OSError, ValueError, IndexError):
        return True
    return True


def check_cuda_fp8_capability() -> bool:
    """Whether the first CUDA GPU has compute capability 8.9 or newer (FP8 tensor cores)."""
    try:
        first = _nvidia_smi("compute_capability")[0]
        capability = tuple(int(part) for part in first.split("."))
    except (OSError, ValueError, IndexError):
        if not torch.cuda.is_available():
            return False
        capability = tuple(torch.cuda.get_device_capability())
    return capability >= (8, 9)


def override_numa_affinity(local_process_index: int, verbose: bool | None = None) -> None:
    """Pin this process to the CPUs of the NUMA node of its GPU (``local_process_index``).

    Does nothing without CUDA. ``verbose`` (default: ``ACCEL_DEBUG_MODE``) logs the CPUs.
    """
    from .environment import ACCEL_DEBUG_MODE, parse_flag_from_env

    if not torch.cuda.is_available():
        return
    index = local_process_index % max(1, torch.cuda.device_count())
    cpus = pin_to_numa_node_of(torch.device("cuda", index))
    if cpus is not None and (parse_flag_from_env(ACCEL_DEBUG_MODE) if verbose is None else verbose):
        import logging

        logging.getLogger("accel_state.devices").info(
            "process %d pinned to CPUs %s", local_process_index, sorted(cpus)
        )


def set_numa_affinity(local_process_index: int, verbose: bool | None = None) -> None:
    """Pin this process to its GPU's NUMA node once (later calls keep the first choice)."""
    if local_process_index in _PINNED:
        return
    override_numa_affinity(local_process_index, verbose)
    _PINNED.add(local_process_index)


_PINNED: set[int] = set()
