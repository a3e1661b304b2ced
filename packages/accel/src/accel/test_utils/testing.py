"""Test helpers for suites that test accel code: skip decorators, launch commands, test cases.

The names are those of Accelerate's ``accelerate.test_utils.testing``, so a project's own test
suite keeps working after the rename. Importing this module needs nothing beyond accel: pytest
is imported only by :func:`run_first`, numpy only by the training helpers.

Every ``require_<x>`` decorator skips a test (``unittest.skipUnless``) when ``<x>`` is missing.
For the engines (``require_deepspeed``, ``require_fsdp2``, ``require_tp``, ``require_tpu``) that
means the library *and* accel's engine for it, as the engine registry reports it available, so
a test whose engine would be refused skips instead of failing on the refusal.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import unittest
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import torch

from accel_state import AcceleratorState, GradientState, gather
from accel_state import engine_requests as _engines
from accel_state import imports as _imports
from accel_state.devices import check_cuda_fp8_capability
from accel_state.environment import parse_flag_from_env

# Accelerate's testing module exposes these two probes too; suites import them from here.
from accel_state.imports import is_hpu_available as is_hpu_available
from accel_state.imports import is_xpu_available as is_xpu_available

__all__ = [
    "DEFAULT_LAUNCH_COMMAND",
    "AccelerateTestCase",
    "MockingTestCase",
    "SubprocessCallException",
    "TempDirTestCase",
    "are_the_same_tensors",
    "assert_exception",
    "capture_call_output",
    "device_count",
    "execute_subprocess_async",
    "get_backend",
    "get_launch_command",
    "get_torch_dist_unique_port",
    "memory_allocated_func",
    "parse_flag_from_env",
    "path_in_accelerate_package",
    "pytest_xdist_worker_id",
    "require_aim",
    "require_bnb",
    "require_clearml",
    "require_comet_ml",
    "require_cpu",
    "require_cuda",
    "require_cuda_or_hpu",
    "require_cuda_or_xpu",
    "require_datasets",
    "require_deepspeed",
    "require_dvclive",
    "require_fp8",
    "require_fp16",
    "require_fsdp2",
    "require_huggingface_suite",
    "require_import_timer",
    "require_matplotlib",
    "require_mlflow",
    "require_mlu",
    "require_mps",
    "require_multi_device",
    "require_multi_gpu",
    "require_multi_gpu_or_xpu",
    "require_multi_xpu",
    "require_musa",
    "require_neuron",
    "require_non_cpu",
    "require_non_hpu",
    "require_non_torch_xla",
    "require_non_xpu",
    "require_npu",
    "require_pandas",
    "require_peft",
    "require_pippy",
    "require_schedulefree",
    "require_sdaa",
    "require_single_device",
    "require_single_gpu",
    "require_single_xpu",
    "require_swanlab",
    "require_tensorboard",
    "require_timm",
    "require_torch_min_version",
    "require_torchao",
    "require_torchdata_stateful_dataloader",
    "require_torchvision",
    "require_tp",
    "require_tpu",
    "require_trackers",
    "require_trackio",
    "require_transformer_engine",
    "require_transformer_engine_mxfp8",
    "require_transformers",
    "require_triton",
    "require_wandb",
    "require_xpu",
    "run_command",
    "run_first",
    "skip",
    "slow",
    "torch_device",
]

_T = TypeVar("_T", bound=Callable[..., Any])


# --- the backend ------------------------------------------------------------------------------


def _count(module_name: str) -> int:
    module = getattr(torch, module_name, None)
    return int(module.device_count()) if module is not None else 0


def _allocated(module_name: str) -> Callable[[], int]:
    module = getattr(torch, module_name)
    return lambda: int(module.memory_allocated())


def _mps_allocated() -> int:
    current = getattr(torch.mps, "current_allocated_memory", None)
    return int(current()) if current is not None else 0


def get_backend() -> tuple[str, int, Callable[[], int]]:
    """``(device type, device count, memory-allocated function)`` of this machine."""
    probes: list[tuple[str, Callable[[], bool]]] = [
        ("xla", _imports.is_torch_xla_available),
        ("cuda", _imports.is_cuda_available),
        ("mps", _imports.is_mps_available),
        ("mlu", _imports.is_mlu_available),
        ("sdaa", _imports.is_sdaa_available),
        ("musa", _imports.is_musa_available),
        ("npu", _imports.is_npu_available),
        ("xpu", _imports.is_xpu_available),
        ("hpu", _imports.is_hpu_available),
        ("neuron", _imports.is_neuron_available),
    ]
    for kind, available in probes:
        if not available():
            continue
        if kind == "xla":
            return kind, _count("cuda"), _allocated("cuda")
        if kind == "mps":
            return kind, 1, _mps_allocated
        return kind, _count(kind), _allocated(kind)
    return "cpu", 1, lambda: 0


torch_device, device_count, memory_allocated_func = get_backend()


def get_launch_command(**kwargs: Any) -> list[str]:
    """``["accel", "launch", ...]`` with one ``--key=value`` per keyword (``--key`` for True).

    ``get_launch_command(num_processes=2)`` is ``["accel", "launch", "--num_processes=2"]``;
    False and None values are left out.
    """
    command = ["accel", "launch"]
    for key, value in kwargs.items():
        if value is True:
            command.append(f"--{key}")
        elif value is not None and value is not False:
            command.append(f"--{key}={value}")
    return command


#: ``accel launch`` on every device of this machine, polling its ranks every 0.1 s.
DEFAULT_LAUNCH_COMMAND = get_launch_command(num_processes=device_count, monitor_interval=0.1)


# --- skip decorators --------------------------------------------------------------------------


def _requirement(name: str, condition: Callable[[], bool], reason: str) -> Callable[[_T], _T]:
    def decorator(test_case: _T) -> _T:
        return unittest.skipUnless(condition(), reason)(test_case)

    decorator.__name__ = decorator.__qualname__ = name
    decorator.__doc__ = f"Skip the test unless it can run: {reason}."
    return decorator


def _engine(key: str) -> bool:
    return _engines.ENGINES[key].available


def skip(test_case: _T) -> _T:
    """Skip the test unconditionally."""
    return unittest.skip("Test was skipped")(test_case)


def slow(test_case: _T) -> _T:
    """Mark a test as slow: it runs only when ``RUN_SLOW`` is true."""
    return unittest.skipUnless(parse_flag_from_env("RUN_SLOW"), "test is slow")(test_case)


def _cuda() -> bool:
    return _imports.is_cuda_available() and not _imports.is_torch_xla_available()


def _fp8() -> bool:
    if not _imports.is_fp8_available() or _imports.is_habana_gaudi1():
        return False
    return not torch.cuda.is_available() or check_cuda_fp8_capability()


def _trackers() -> bool:
    probes = (
        _imports.is_wandb_available,
        _imports.is_tensorboard_available,
        _imports.is_trackio_available,
        _imports.is_swanlab_available,
    )
    return any(probe() for probe in probes) and not _imports.is_comet_ml_available()


def _transformers_at_least(version: str) -> bool:
    installed = _imports.get_package_version("transformers")
    return installed is not None and _imports.compare_versions(installed, ">=", version)


require_cpu = _requirement("require_cpu", lambda: torch_device == "cpu", "test requires only a CPU")
require_non_cpu = _requirement(
    "require_non_cpu", lambda: torch_device != "cpu", "test requires a GPU"
)
require_cuda = _requirement("require_cuda", _cuda, "test requires a GPU")
require_cuda_or_hpu = _requirement(
    "require_cuda_or_hpu",
    lambda: _cuda() or _imports.is_hpu_available(),
    "test requires a GPU or HPU",
)
require_xpu = _requirement("require_xpu", _imports.is_xpu_available, "test requires a XPU")
require_cuda_or_xpu = _requirement(
    "require_cuda_or_xpu",
    lambda: _cuda() or _imports.is_xpu_available(),
    "test requires a CUDA GPU or XPU",
)
require_non_xpu = _requirement(
    "require_non_xpu", lambda: torch_device != "xpu", "test requires a non-XPU"
)
require_non_hpu = _requirement(
    "require_non_hpu", lambda: torch_device != "hpu", "test requires a non-HPU"
)
require_fp16 = _requirement(
    "require_fp16", _imports.is_fp16_available, "test requires FP16 support"
)
require_fp8 = _requirement("require_fp8", _fp8, "test requires FP8 support")
require_fsdp2 = _requirement(
    "require_fsdp2",
    lambda: _imports.is_torch_version(">=", "2.5.0") and _engine("fsdp"),
    "test requires FSDP2 (torch >= 2.5.0 and accel's FSDP engine)",
)
require_peft = _requirement("require_peft", _imports.is_peft_available, "test requires PEFT")
require_mlu = _requirement("require_mlu", _imports.is_mlu_available, "test require a MLU")
require_sdaa = _requirement("require_sdaa", _imports.is_sdaa_available, "test require a SDAA")
require_musa = _requirement("require_musa", _imports.is_musa_available, "test require a MUSA")
require_npu = _requirement("require_npu", _imports.is_npu_available, "test require a NPU")
require_neuron = _requirement(
    "require_neuron", _imports.is_neuron_available, "test require Neuron Cores"
)
require_mps = _requirement(
    "require_mps", _imports.is_mps_available, "test requires a `mps` backend support in `torch`"
)
require_huggingface_suite = _requirement(
    "require_huggingface_suite",
    lambda: _imports.is_transformers_available() and _imports.is_datasets_available(),
    "test requires the Hugging Face suite",
)
require_datasets = _requirement(
    "require_datasets", _imports.is_datasets_available, "test requires the datasets library"
)
require_transformers = _requirement(
    "require_transformers",
    _imports.is_transformers_available,
    "test requires the transformers library",
)
require_timm = _requirement(
    "require_timm", _imports.is_timm_available, "test requires the timm library"
)
require_torchvision = _requirement(
    "require_torchvision",
    _imports.is_torchvision_available,
    "test requires the torchvision library",
)
require_triton = _requirement(
    "require_triton", _imports.is_triton_available, "test requires the triton library"
)
require_schedulefree = _requirement(
    "require_schedulefree",
    _imports.is_schedulefree_available,
    "test requires the schedulefree library",
)
require_bnb = _requirement(
    "require_bnb", _imports.is_bnb_available, "test requires the bitsandbytes library"
)
require_tpu = _requirement(
    "require_tpu",
    lambda: _imports.is_torch_xla_available(check_is_tpu=True) and _engine("xla"),
    "test requires TPU (and accel's XLA engine)",
)
require_non_torch_xla = _requirement(
    "require_non_torch_xla",
    lambda: not _imports.is_torch_xla_available(),
    "test requires an env without TorchXLA",
)
require_single_device = _requirement(
    "require_single_device",
    lambda: torch_device != "cpu" and device_count == 1,
    "test requires a single device accelerator",
)
require_single_gpu = _requirement(
    "require_single_gpu", lambda: _count("cuda") == 1, "test requires a GPU"
)
require_single_xpu = _requirement(
    "require_single_xpu", lambda: _count("xpu") == 1, "test requires a XPU"
)
require_multi_device = _requirement(
    "require_multi_device",
    lambda: device_count > 1,
    "test requires multiple hardware accelerators",
)
require_multi_gpu = _requirement(
    "require_multi_gpu", lambda: _count("cuda") > 1, "test requires multiple GPUs"
)
require_multi_xpu = _requirement(
    "require_multi_xpu", lambda: _count("xpu") > 1, "test requires multiple XPUs"
)
require_multi_gpu_or_xpu = _requirement(
    "require_multi_gpu_or_xpu",
    lambda: (_imports.is_cuda_available() or _imports.is_xpu_available()) and device_count > 1,
    "test requires multiple GPUs or XPUs",
)
require_deepspeed = _requirement(
    "require_deepspeed",
    lambda: _imports.is_deepspeed_available() and _engine("deepspeed"),
    "test requires DeepSpeed (the library and accel's DeepSpeed engine)",
)
require_tp = _requirement(
    "require_tp",
    lambda: (
        _imports.is_torch_version(">=", "2.3.0")
        and _transformers_at_least("4.52.0")
        and _engine("parallelism_config")
    ),
    "test requires torch version >= 2.3.0 and transformers version >= 4.52.0 (and accel's "
    "ParallelismConfig engine)",
)
require_tensorboard = _requirement(
    "require_tensorboard", _imports.is_tensorboard_available, "test requires Tensorboard"
)
require_wandb = _requirement("require_wandb", _imports.is_wandb_available, "test requires wandb")
require_trackio = _requirement(
    "require_trackio", _imports.is_trackio_available, "test requires trackio"
)
require_comet_ml = _requirement(
    "require_comet_ml", _imports.is_comet_ml_available, "test requires comet_ml"
)
require_aim = _requirement("require_aim", _imports.is_aim_available, "test requires aim")
require_clearml = _requirement(
    "require_clearml", _imports.is_clearml_available, "test requires clearml"
)
require_dvclive = _requirement(
    "require_dvclive", _imports.is_dvclive_available, "test requires dvclive"
)
require_swanlab = _requirement(
    "require_swanlab", _imports.is_swanlab_available, "test requires swanlab"
)
require_pandas = _requirement(
    "require_pandas", _imports.is_pandas_available, "test requires pandas"
)
require_mlflow = _requirement(
    "require_mlflow", _imports.is_mlflow_available, "test requires mlflow"
)
require_pippy = _requirement(
    "require_pippy",
    lambda: _imports.is_pippy_available() and not _imports.is_habana_gaudi1(),
    "test requires pippy",
)
require_import_timer = _requirement(
    "require_import_timer", _imports.is_import_timer_available, "test requires tuna interpreter"
)
require_transformer_engine = _requirement(
    "require_transformer_engine",
    _imports.is_transformer_engine_available,
    "test requires transformers engine",
)
require_transformer_engine_mxfp8 = _requirement(
    "require_transformer_engine_mxfp8",
    _imports.is_transformer_engine_mxfp8_available,
    "test requires transformers engine MXFP8 block scaling",
)
require_torchao = _requirement(
    "require_torchao", _imports.is_torchao_available, "test requires torchao"
)
require_matplotlib = _requirement(
    "require_matplotlib", _imports.is_matplotlib_available, "test requires matplotlib"
)
require_trackers = _requirement(
    "require_trackers",
    _trackers,
    "test requires at least one tracker to be available and for `comet_ml` to not be installed",
)
require_torchdata_stateful_dataloader = _requirement(
    "require_torchdata_stateful_dataloader",
    _imports.is_torchdata_stateful_dataloader_available,
    "test requires torchdata.stateful_dataloader",
)


def require_torch_min_version(test_case: Any = None, version: str | None = None) -> Any:
    """Skip the test unless torch >= ``version``; ``@require_torch_min_version(version="2.4")``.

    Raises:
        ValueError: no ``version`` was given.
    """
    if version is None:
        raise ValueError("require_torch_min_version needs version=..., e.g. version='2.4.0'")
    if test_case is None:
        return lambda case: require_torch_min_version(case, version=version)
    return unittest.skipUnless(
        _imports.is_torch_version(">=", version), f"test requires torch version >= {version}"
    )(test_case)


def run_first(test_case: _T) -> _T:
    """Run the test first when the pytest-order plugin is installed (a no-op otherwise)."""
    if not _imports.is_pytest_available():
        return test_case
    import pytest

    return cast(_T, pytest.mark.order(1)(test_case))


# --- test cases -------------------------------------------------------------------------------


class TempDirTestCase(unittest.TestCase):
    """One temporary directory for the whole class (``self.tmpdir``), emptied before each test.

    Set ``clear_on_setup = False`` to keep its contents between tests.
    """

    clear_on_setup = True
    tmpdir: Path

    @classmethod
    def setUpClass(cls) -> None:
        """Create the class's temporary directory."""
        cls.tmpdir = Path(tempfile.mkdtemp())

    @classmethod
    def tearDownClass(cls) -> None:
        """Remove the temporary directory and everything in it."""
        shutil.rmtree(cls.tmpdir, ignore_errors=True)

    def setUp(self) -> None:
        """Empty the temporary directory (unless ``clear_on_setup`` is False)."""
        if not self.clear_on_setup:
            return
        for path in list(self.tmpdir.iterdir()):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


class AccelerateTestCase(unittest.TestCase):
    """Forget the ``AcceleratorState``, ``PartialState`` and ``GradientState`` after each test."""

    def tearDown(self) -> None:
        """Reset the singletons, so the next test builds its own state."""
        super().tearDown()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


class MockingTestCase(unittest.TestCase):
    """A test case whose ``setUp`` can start mocks that stop after each test (``add_mocks``)."""

    mocks: list[Any]

    def add_mocks(self, mocks: Any) -> None:
        """Start ``mocks`` (one patcher or a list) now and stop them when the test ends.

        Call it at the end of ``setUp``, after ``super().setUp()``.
        """
        self.mocks = list(mocks) if isinstance(mocks, (list, tuple)) else [mocks]
        for patcher in self.mocks:
            patcher.start()
            self.addCleanup(patcher.stop)


# --- helpers ----------------------------------------------------------------------------------


def are_the_same_tensors(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is equal on every process (a collective: every rank must call it)."""
    state = AcceleratorState()
    local = tensor[None].clone().to(state.device)
    everyone = gather(local).cpu()
    mine = local[0].cpu()
    return all(torch.equal(row, mine) for row in everyone)


class _RunOutput:
    """What :func:`execute_subprocess_async` returns: the exit code and the output lines."""

    def __init__(self, returncode: int, stdout: list[str], stderr: list[str]) -> None:
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr


def _pump(stream: Any, sink: list[str], echo_to: Any, label: str, quiet: bool) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace").rstrip()
        sink.append(line)
        if not quiet:
            print(label, line, file=echo_to, flush=True)
    stream.close()


def execute_subprocess_async(
    cmd: list[Any],
    env: dict[str, str] | None = None,
    stdin: Any = None,
    timeout: float | None = 180,
    quiet: bool = False,
    echo: bool = True,
) -> _RunOutput:
    """Run ``cmd``, echoing its output line by line as it comes, and return what it printed.

    Args:
        cmd: The command (paths are turned into strings).
        env: Its environment (default: this one).
        stdin: Its standard input.
        timeout: Seconds after which it is killed (then the error says so).
        quiet: Do not echo its output.
        echo: Print the command first.

    Raises:
        RuntimeError: it exited with a non-zero code or ran past ``timeout``; the message
            holds its standard error.
    """
    command = [str(part) for part in cmd]
    if echo:
        print("\nRunning: ", " ".join(command))
    process = subprocess.Popen(
        command, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    out: list[str] = []
    err: list[str] = []
    readers = [
        threading.Thread(target=_pump, args=(process.stdout, out, sys.stdout, "stdout:", quiet)),
        threading.Thread(target=_pump, args=(process.stderr, err, sys.stderr, "stderr:", quiet)),
    ]
    for reader in readers:
        reader.start()
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        for reader in readers:
            reader.join()
        raise RuntimeError(
            f"'{' '.join(command)}' ran past its timeout of {timeout} s and was killed\n\n"
            "The combined stderr from workers follows:\n" + "\n".join(err)
        ) from None
    for reader in readers:
        reader.join()
    if code > 0:
        raise RuntimeError(
            f"'{' '.join(command)}' failed with returncode {code}\n\n"
            "The combined stderr from workers follows:\n" + "\n".join(err)
        )
    return _RunOutput(code, out, err)


def pytest_xdist_worker_id() -> int:
    """The number of this pytest-xdist worker (``gw3`` -> 3), 0 without xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(re.sub(r"^gw", "", worker))


def get_torch_dist_unique_port() -> int:
    """A rendezvous port unique to this pytest-xdist worker (29500 + its number)."""
    return 29500 + pytest_xdist_worker_id()


class SubprocessCallException(Exception):
    """A command run by :func:`run_command` failed (its output is in the message)."""


def run_command(
    command: Sequence[Any], return_stdout: bool = False, env: dict[str, str] | None = None
) -> str | None:
    """Run ``command``; return its output (stdout and stderr) when ``return_stdout``.

    Raises:
        SubprocessCallException: it exited with a non-zero code; the message holds its output.
    """
    parts = [str(part) for part in command]
    try:
        output = subprocess.check_output(
            parts, stderr=subprocess.STDOUT, env=os.environ.copy() if env is None else env
        )
    except subprocess.CalledProcessError as error:
        raise SubprocessCallException(
            f"Command `{' '.join(parts)}` failed with the following error:\n\n"
            f"{error.output.decode(errors='replace')}"
        ) from error
    return output.decode("utf-8", errors="replace") if return_stdout else None


def path_in_accelerate_package(*components: str) -> Path:
    """A path inside the installed ``accel`` package (Accelerate's name for it)."""
    import accel

    return Path(inspect.getfile(accel)).parent.joinpath(*components)


@contextlib.contextmanager
def assert_exception(
    exception_class: type[BaseException], msg: str | None = None
) -> Iterator[None]:
    """Assert that the block raises ``exception_class`` (with ``msg`` in its message, if given).

    Raises:
        AssertionError: the block raised nothing, another class, or another message.
    """
    try:
        yield
    except Exception as error:  # noqa: BLE001 - compared with the expected class below
        assert isinstance(error, exception_class), (
            f"Expected exception of type {exception_class} but got {type(error)}"
        )
        if msg is not None:
            assert msg in str(error), (
                f"Expected message '{msg}' to be in exception but got '{error}'"
            )
        return
    raise AssertionError(f"Expected exception of type {exception_class} but ran without issue.")


def capture_call_output(func: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """Call ``func(*args, **kwargs)`` and return what it printed to stdout."""
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        func(*args, **kwargs)
    return captured.getvalue()
