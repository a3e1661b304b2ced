"""Checkpoints move both ways between accel and Accelerate 1.15 (same file names and formats).

Accelerate runs from its own virtualenv (tools/reference_venv.py); the ``integration`` nox
session creates it and passes its interpreter in ``ACCEL_REFERENCE_PYTHON``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "scripts" / "compat_checkpoint.py"
REFERENCE = os.environ.get("ACCEL_REFERENCE_PYTHON", "")

pytestmark = pytest.mark.skipif(
    not (REFERENCE and Path(REFERENCE).exists()),
    reason=(
        "Accelerate 1.15's virtualenv is not available: set ACCEL_REFERENCE_PYTHON to its "
        "python (python3 tools/reference_venv.py creates it; `python3 tools/dev.py test` does)"
    ),
)


def _run(python: str, lib: str, mode: str, directory: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "ACCEL_USE_CPU": "1"}
    command = [python, str(SCRIPT), "--lib", lib, "--mode", mode, "--dir", str(directory)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize(
    ("saver", "loader"), [("accelerate", "accel"), ("accel", "accelerate")], ids=str
)
def test_checkpoint_round_trip_between_libraries(saver: str, loader: str, tmp_path: Path) -> None:
    python = {"accel": sys.executable, "accelerate": REFERENCE}
    directory = tmp_path / "checkpoint"
    saved = _run(python[saver], saver, "save", directory)
    assert saved.returncode == 0, saved.stdout + saved.stderr
    assert (directory / "model.safetensors").exists()
    assert (directory / "optimizer.bin").exists()
    loaded = _run(python[loader], loader, "load", directory)
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr
    assert f"compat: OK (loaded with {loader})" in loaded.stdout


# Each plugin class: its constructor parameters with their defaults, as text (importable in
# both libraries under these module paths once "accelerate" is renamed "accel").
_SIGNATURES = """
import dataclasses, inspect, json, sys
lib = sys.argv[1]
utils = __import__(lib + ".utils", fromlist=["x"])
parallelism = __import__(lib + ".parallelism_config", fromlist=["x"])
top = __import__(lib)
names = ["FullyShardedDataParallelPlugin", "DeepSpeedPlugin", "MegatronLMPlugin",
         "TorchTensorParallelPlugin", "TorchTensorParallelConfig", "TorchContextParallelConfig",
         "DeepSpeedSequenceParallelConfig"]
out = {}
for name in names:
    cls = getattr(utils, name)
    out[name] = [(p.name, repr(p.default)) for p in inspect.signature(cls).parameters.values()]
cls = parallelism.ParallelismConfig
out["ParallelismConfig"] = [
    (p.name, repr(p.default)) for p in inspect.signature(cls).parameters.values()
]
out["top"] = sorted(n for n in ("FullyShardedDataParallelPlugin", "DeepSpeedPlugin",
                                "ParallelismConfig") if hasattr(top, n))
print(json.dumps(out))
"""


def _signatures(python: str, lib: str) -> dict[str, object]:
    done = subprocess.run(
        [python, "-c", _SIGNATURES, lib], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_engine_plugins_have_accelerates_signatures() -> None:
    ours = _signatures(sys.executable, "accel")
    theirs = _signatures(REFERENCE, "accelerate")
    assert ours == theirs


_ORDER_SCRIPT = Path(__file__).resolve().parent / "scripts" / "data_order.py"


def _orders(python: str, lib: str, processes: int, out: Path) -> list[object]:
    command = [python, str(_ORDER_SCRIPT), "--lib", lib, "--out", str(out)]
    if processes > 1:
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        command = [python, *launcher, *command[1:]]
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "1",
        "ACCEL_USE_CPU": "1",
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
    }
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(processes)]


@pytest.mark.parametrize("processes", [1, 2])
def test_prepared_loaders_yield_accelerates_batches(processes: int, tmp_path: Path) -> None:
    """The same seed gives the same batches on every rank, seedable sampler or not."""
    ours = _orders(sys.executable, "accel", processes, tmp_path / "accel")
    theirs = _orders(REFERENCE, "accelerate", processes, tmp_path / "accelerate")
    assert ours == theirs
    assert len(ours[0]) == 4 and all(len(epochs) == 3 for epochs in ours[0].values())


_SURFACE = Path(__file__).resolve().parents[1] / "packages" / "accel" / "tests" / "surface.toml"
# accel's own names in its Accelerate-compatible modules (documented in docs/compat.md).
_ACCEL_ONLY = {
    "accel.utils": {
        "purge_accel_environment",
        "TENSOR_PARALLEL_STYLES",
        "apply_tensor_parallel",
        "tensor_parallel_plan",
    },
    "accel.utils.deepspeed": {"zero3_init_context"},
    "accel.tracking": {"JSONLTracker"},
    "accel": {"load_pretrained", "install_as_accelerate"},
    "accel.big_modeling": {"load_pretrained"},
}

# The names accelerate.utils exports only when deepspeed is installed (they live in
# accelerate.utils.deepspeed); accel.utils always exports them, importing no deepspeed.
_ACCELERATE_UTILS_WITH_DEEPSPEED = {
    "DeepSpeedEngineWrapper",
    "DeepSpeedOptimizerWrapper",
    "DeepSpeedSchedulerWrapper",
    "DummyOptim",
    "DummyScheduler",
    "HfDeepSpeedConfig",
    "get_active_deepspeed_plugin",
    "map_pytorch_optim_to_deepspeed",
}

_ACCELERATE_NAMES = """
import importlib, json, pkgutil, sys, types
modules = json.loads(sys.argv[1])
utils = importlib.import_module("accelerate.utils")
submodules = [importlib.import_module("accelerate.utils." + m.name)
              for m in pkgutil.iter_modules(utils.__path__) if m.name != "rich"]
def public(module):
    return {n for n, v in vars(module).items() if not isinstance(v, types.ModuleType)
            and (not n.startswith("_") or n == "__version__")}
flat, anywhere = {}, {}
for module in modules:
    target = importlib.import_module("accelerate" + module[len("accel"):])
    flat[module] = sorted(public(target))
    names = public(target)
    if module == "accel.utils":
        for sub in submodules:
            names |= public(sub)
    anywhere[module] = sorted(names)
print(json.dumps({"flat": flat, "anywhere": anywhere}))
"""


def test_every_name_accel_offers_is_accelerates() -> None:
    """The surface lists hold Accelerate's names and cover ``accelerate`` and its ``utils``."""
    import tomllib

    surface = tomllib.loads(_SURFACE.read_text(encoding="utf-8"))
    done = subprocess.run(
        [REFERENCE, "-c", _ACCELERATE_NAMES, json.dumps(sorted(surface))],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "ACCELERATE_USE_CPU": "1"},
    )
    assert done.returncode == 0, done.stderr
    theirs = json.loads(done.stdout.splitlines()[-1])
    for module, names in surface.items():
        extra = set(names) - set(theirs["anywhere"][module]) - _ACCEL_ONLY.get(module, set())
        assert not extra, f"{module} offers names Accelerate 1.15 does not have there: {extra}"
    for module in ("accel", "accel.utils"):
        missing = set(theirs["flat"][module]) - set(surface[module])
        assert not missing, f"Accelerate 1.15's {module} names that accel lacks: {missing}"
    # Accelerate's flat accelerate.utils has the DeepSpeed names exactly when deepspeed is
    # installed beside it; accel.utils has them either way.
    with_deepspeed = _ACCELERATE_UTILS_WITH_DEEPSPEED
    assert with_deepspeed <= set(theirs["flat"]["accel.utils.deepspeed"])
    assert with_deepspeed <= set(surface["accel.utils"])
    assert with_deepspeed & set(theirs["flat"]["accel.utils"]) in (set(), with_deepspeed)


_LAUNCH_FLAGS = (
    Path(__file__).resolve().parents[1]
    / "packages"
    / "accel-launch"
    / "tests"
    / "accelerate_launch_flags.txt"
)
_ACCELERATE_FLAGS = """
from accelerate.commands.launch import launch_command_parser
for action in launch_command_parser()._actions:
    longs = [o for o in action.option_strings if o.startswith("--")]
    if not longs or action.dest == "help":
        continue
    many = action.nargs in ("+", "*") or type(action).__name__ == "_AppendAction"
    kind = "switch" if action.nargs == 0 else ("list" if many else "value")
    print(longs[0].lstrip("-").replace("-", "_"), kind)
"""


def test_the_launch_flag_list_is_accelerates() -> None:
    """accel-launch's test of every flag works from Accelerate 1.15's own list."""
    done = subprocess.run(
        [REFERENCE, "-c", _ACCELERATE_FLAGS],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "ACCELERATE_USE_CPU": "1"},
    )
    assert done.returncode == 0, done.stderr
    theirs = sorted(line for line in done.stdout.splitlines() if line.strip())
    listed = [
        line
        for line in _LAUNCH_FLAGS.read_text(encoding="utf-8").splitlines()
        if line and not line.startswith("#")
    ]
    assert listed == theirs


_FSDP2_SCRIPT = Path(__file__).resolve().parent / "scripts" / "fsdp2_compat.py"


def _fsdp2(python: str, lib: str, mode: str, directory: Path) -> subprocess.CompletedProcess[str]:
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command = [python, *launcher, str(_FSDP2_SCRIPT), "--lib", lib, "--mode", mode]
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "1",
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
    }
    env.pop("ACCEL_USE_CPU", None)  # accel would then train DDP, not the FSDP2 asked for
    return subprocess.run(
        [*command, "--dir", str(directory)], capture_output=True, text=True, timeout=300, env=env
    )


@pytest.mark.parametrize(
    ("saver", "loader"), [("accelerate", "accel"), ("accel", "accelerate")], ids=str
)
def test_fsdp2_checkpoints_move_between_libraries(saver: str, loader: str, tmp_path: Path) -> None:
    """Sharded DCP folders of one library load in the other, optimizer state included."""
    python = {"accel": sys.executable, "accelerate": REFERENCE}
    directory = tmp_path / "checkpoint"
    saved = _fsdp2(python[saver], saver, "save", directory)
    assert saved.returncode == 0, saved.stdout + saved.stderr
    assert (directory / "pytorch_model_fsdp_0" / ".metadata").exists()
    assert (directory / "optimizer_0" / ".metadata").exists()
    loaded = _fsdp2(python[loader], loader, "load", directory)
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr
    assert f"compat: OK (loaded with {loader})" in loaded.stdout


# Accelerate modules accel has no counterpart of (docs/compat.md, "the accelerate alias").
_NOT_UNDER_THE_ALIAS = (
    "accelerate.commands.menu",
    "accelerate.commands.utils",
    "accelerate.commands.config.sagemaker",
    "accelerate.utils.rich",
    "accelerate.test_utils.scripts",
    "accelerate.test_utils.examples",
)

_ACCELERATE_MODULES = """
import json, pkgutil, accelerate
found = pkgutil.walk_packages(accelerate.__path__, "accelerate.", onerror=lambda name: None)
print(json.dumps(sorted(info.name for info in found)))
"""

_UNDER_THE_ALIAS = """
import importlib, json, sys, warnings
import accel
accel.install_as_accelerate()
warnings.simplefilter("ignore")  # accelerate.memory_utils warns, as Accelerate's does
failed, foreign = {}, []
for name in json.loads(sys.argv[1]):
    try:
        module = importlib.import_module(name)
    except Exception as error:
        failed[name] = repr(error)
        continue
    if not (module.__name__ == "accel" or module.__name__.startswith("accel.")):
        foreign.append(name)
print(json.dumps({"failed": failed, "foreign": foreign}))
"""


def test_every_accelerate_module_resolves_to_accels_under_the_alias() -> None:
    listed = subprocess.run(
        [REFERENCE, "-c", _ACCELERATE_MODULES],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "ACCELERATE_USE_CPU": "1"},
    )
    assert listed.returncode == 0, listed.stderr
    theirs = json.loads(listed.stdout.splitlines()[-1])
    wanted = [name for name in theirs if not name.startswith(_NOT_UNDER_THE_ALIAS)]
    assert len(wanted) > 50, wanted  # Accelerate's modules, not an empty walk
    done = subprocess.run(
        [sys.executable, "-c", _UNDER_THE_ALIAS, json.dumps(wanted)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result == {"failed": {}, "foreign": []}
