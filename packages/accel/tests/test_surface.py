"""The Accelerate-compatible import surface of ``accel``.

``accel``, ``accel.utils`` (and its submodules, named as Accelerate's) and the thin modules
(``accel.state``, ``accel.data_loader``, ``accel.hooks``, ``accel.local_sgd``,
``accel.test_utils``, ...) export exactly the names listed in ``surface.toml``. They are
re-exports: every function and class comes from the sibling package or ``accel`` module that
defines it, never a copy, and a name means one object wherever it is offered. Names whose
feature accel lacks import, and using them raises ``NotImplementedError`` that names them.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

import accel
import accel.utils
import accel_amp
import accel_bigmodel
import accel_data
import accel_state
from accel import handlers, memory, models
from accel.accelerator import Accelerator
from accel_state import topology as state_topology

SURFACE: dict[str, list[str]] = tomllib.loads(
    (Path(__file__).with_name("surface.toml")).read_text(encoding="utf-8")
)
EXPECTED_ACCEL = SURFACE["accel"]
EXPECTED_UTILS = SURFACE["accel.utils"]
MODULES = sorted(SURFACE)

# The thin modules and the package that owns their names.
THIN_OWNERS: dict[str, ModuleType] = {
    "accel.state": accel_state,
    "accel.data_loader": accel_data,
    "accel.optimizer": accel_amp,
    "accel.scheduler": accel_amp,
    "accel.logging": accel_state,
    "accel.big_modeling": accel_bigmodel,
    "accel.hooks": accel_bigmodel,
}


def _named(module_name: str) -> list[tuple[str, object]]:
    module = importlib.import_module(module_name)
    return [(name, getattr(module, name)) for name in SURFACE[module_name]]


def _is_unavailable(obj: object) -> bool:
    return (inspect.isfunction(obj) or inspect.isclass(obj)) and (obj.__doc__ or "").startswith(
        "Not available in accel:"
    )


# --- (a) the exact lists ----------------------------------------------------------------------


def test_expected_lists_are_sorted_and_unique() -> None:
    for names in SURFACE.values():
        assert names == sorted(names)
        assert len(set(names)) == len(names)


@pytest.mark.parametrize("module_name", MODULES)
def test_module_all_is_the_list(module_name: str) -> None:
    module = importlib.import_module(module_name)
    assert sorted(module.__all__) == SURFACE[module_name]
    assert module.__doc__


def test_every_utils_submodule_is_listed() -> None:
    import pkgutil

    found = {f"accel.utils.{info.name}" for info in pkgutil.iter_modules(accel.utils.__path__)}
    assert found == {name for name in SURFACE if name.startswith("accel.utils.")}


def test_purge_accelerate_environment_covers_both_prefixes() -> None:
    # Accelerate's name watches ACCELERATE_* (a migrated suite sets those) and ACCEL_* alike;
    # accel's own name only ACCEL_*.
    assert accel.utils.purge_accel_environment is accel_state.purge_accel_environment
    from accel_state import environment

    assert accel.utils.purge_accelerate_environment is environment.purge_accelerate_environment


# --- (b) re-exports only: every name is its owner's object ------------------------------------


@pytest.mark.parametrize("module_name", [m for m in MODULES if m.startswith("accel.utils")])
def test_utils_define_no_code(module_name: str) -> None:
    """Functions and classes of ``accel.utils`` come from where they are implemented."""
    for name, obj in _named(module_name):
        if inspect.isfunction(obj) or inspect.isclass(obj):
            home = obj.__module__
            assert home.startswith(("accel", "torch")), f"{module_name}.{name}: {home}"
            assert not home.startswith("accel.utils"), f"{module_name}.{name} is defined there"


def test_a_name_is_one_object_wherever_it_is_offered() -> None:
    # Except the stand-ins for missing features: Accelerate's Megatron-LM helpers have their
    # own prepare_data_loader, for one.
    meaning: dict[str, tuple[str, object]] = {}
    for module_name in MODULES:
        for name, obj in _named(module_name):
            if _is_unavailable(obj):
                continue
            if name in meaning and not isinstance(obj, (str, int, float, tuple)):
                first, seen = meaning[name]
                assert obj is seen, f"{module_name}.{name} is not {first}.{name}"
            meaning.setdefault(name, (module_name, obj))


@pytest.mark.parametrize("module_name", sorted(THIN_OWNERS))
def test_thin_module_names_are_the_siblings_objects(module_name: str) -> None:
    owner = THIN_OWNERS[module_name]
    for name, obj in _named(module_name):
        assert obj is getattr(owner, name), f"{module_name}.{name}"


def test_accel_names_are_the_siblings_objects() -> None:
    assert accel.Accelerator is Accelerator
    assert accel.PartialState is accel_state.PartialState
    assert accel.DistributedType is accel_state.DistributedType
    assert accel.InitProcessGroupKwargs is accel_state.InitProcessGroupKwargs
    assert accel.synchronize_rng_states is accel_state.synchronize_rng_states
    assert accel.is_rich_available is accel_state.is_rich_available
    assert accel.DataLoaderConfiguration is accel_data.DataLoaderConfiguration
    assert accel.skip_first_batches is accel_data.skip_first_batches
    assert accel.AutocastKwargs is accel_amp.AutocastKwargs
    assert accel.GradScalerKwargs is accel_amp.GradScalerKwargs
    assert accel.DDPCommunicationHookType is handlers.DDPCommunicationHookType
    assert accel.DistributedDataParallelKwargs is handlers.DistributedDataParallelKwargs
    assert accel.ProfileKwargs is handlers.ProfileKwargs
    assert accel.find_executable_batch_size is memory.find_executable_batch_size
    from accel.__about__ import __version__

    assert accel.__version__ == __version__


def test_utils_spot_checks() -> None:
    import functools

    assert accel.utils.gather is accel_state.gather
    assert accel.utils.reduce is accel_state.reduce
    assert accel.utils.reduce is not functools.reduce
    assert accel.utils.DistributedOperationException is accel_state.DistributedOperationException
    assert accel.utils.clear_device_cache is memory.clear_device_cache
    assert accel.utils.clear_device_cache is accel_bigmodel.clear_device_cache
    assert accel.utils.infer_auto_device_map is accel_bigmodel.infer_auto_device_map
    assert accel.utils.extract_model_from_parallel is models.extract_model_from_parallel
    assert accel.utils.ProjectConfiguration is handlers.ProjectConfiguration
    assert accel.utils.TorchDynamoPlugin is handlers.TorchDynamoPlugin
    assert accel.utils.GradientAccumulationPlugin is accel_amp.GradientAccumulationPlugin
    assert accel.utils.CPUInformation is state_topology.CPUInformation
    assert accel.utils.tqdm is accel_state.logging.tqdm


def test_utils_offers_the_deepspeed_names_without_deepspeed() -> None:
    # accelerate.utils offers them only with deepspeed installed; importing them here imports
    # no deepspeed (test_import_accel_in_fresh_interpreter), and they are the engine's own.
    from accel import engine_plugins
    from accel.engines import deepspeed, deepspeed_cpu_optimizer, hf_deepspeed_config

    assert accel.utils.DummyOptim is engine_plugins.DummyOptim
    assert accel.utils.DummyScheduler is engine_plugins.DummyScheduler
    assert accel.utils.DeepSpeedEngineWrapper is deepspeed.DeepSpeedEngineWrapper
    assert accel.utils.DeepSpeedOptimizerWrapper is deepspeed.DeepSpeedOptimizerWrapper
    assert accel.utils.DeepSpeedSchedulerWrapper is deepspeed.DeepSpeedSchedulerWrapper
    assert accel.utils.get_active_deepspeed_plugin is deepspeed.get_active_deepspeed_plugin
    assert accel.utils.HfDeepSpeedConfig is hf_deepspeed_config.HfDeepSpeedConfig
    mapper = deepspeed_cpu_optimizer.map_pytorch_optim_to_deepspeed
    assert accel.utils.map_pytorch_optim_to_deepspeed is mapper


# --- (b') names whose feature accel lacks --------------------------------------------------------


def _unavailable() -> list[tuple[str, object]]:
    found = {}
    for module_name in MODULES:
        for name, obj in _named(module_name):
            if _is_unavailable(obj):
                found.setdefault(name, obj)
    return sorted(found.items())


def test_unavailable_names_are_listed_in_compat_md() -> None:
    compat = (Path(__file__).resolve().parents[3] / "docs" / "compat.md").read_text()
    names = [name for name, _ in _unavailable()]
    assert len(names) > 40  # FSDP, DeepSpeed, Megatron-LM, Transformer Engine, XLA helpers
    missing = [name for name in names if f"`{name}`" not in compat]
    assert not missing, f"not listed in docs/compat.md: {missing}"


@pytest.mark.parametrize(("name", "obj"), _unavailable(), ids=[n for n, _ in _unavailable()])
def test_using_an_unavailable_name_says_what_is_missing(name: str, obj: object) -> None:
    with pytest.raises(NotImplementedError) as info:
        obj()  # type: ignore[operator]
    message = str(info.value)
    assert message.startswith(f"{name} needs "), message
    assert "accel" in message


# --- (c) loggers ---------------------------------------------------------------------------------


def test_import_creates_accelerator_logger() -> None:
    assert "accel.accelerator" in logging.Logger.manager.loggerDict
    assert isinstance(logging.Logger.manager.loggerDict["accel.accelerator"], logging.Logger)


# --- (d) a fresh interpreter: what ``import accel`` loads and what it does not ------------------


def _fresh(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_import_accel_in_fresh_interpreter() -> None:
    out = _fresh(
        "import logging, sys\n"
        "import accel, accel.test_utils, accel.local_sgd, accel.inference\n"
        "heavy = ('deepspeed', 'torch_xla', 'tensorboard', 'torchao', 'pytest', 'transformers',\n"
        "         'datasets', 'peft', 'bitsandbytes')\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in heavy)\n"
        "print(loaded)\n"
        "print('accel.accelerator' in logging.Logger.manager.loggerDict)\n"
        "print(accel.utils.gather is sys.modules['accel_state'].gather)\n"
        "print(logging.getLogger is sys.modules['logging'].getLogger)\n"
    )
    assert out.splitlines() == ["[]", "True", "True", "True"]


def test_accel_logging_does_not_shadow_the_standard_library() -> None:
    out = _fresh(
        "import logging, accel.accelerator, accel.logging\n"
        "print(logging.__name__, accel.logging.__name__, accel.accelerator.logging.__name__)\n"
    )
    assert out == "logging accel.logging logging"


# --- (e) ``from accel... import X`` works for every name ---------------------------------------


@pytest.mark.parametrize("module_name", MODULES)
def test_from_module_import_each_name(module_name: str) -> None:
    module = importlib.import_module(module_name)
    for name in SURFACE[module_name]:
        namespace: dict[str, object] = {}
        exec(f"from {module_name} import {name}", namespace)
        assert namespace[name] is getattr(module, name), f"{module_name}.{name}"


@pytest.mark.parametrize("module_name", MODULES)
def test_star_import(module_name: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"from {module_name} import *", namespace)
    module = importlib.import_module(module_name)
    assert set(namespace) - {"__builtins__"} == set(module.__all__), module_name


# Private names that Accelerate 1.15's own tests import or patch in its modules (the upstream
# session runs those tests; this keeps a refactor from moving them unnoticed in the unit run).
ACCELERATE_TEST_PATCH_POINTS = [
    ("accel.big_modeling", "_refuse_recurrent_layers_under_sequence_parallelism"),
    ("accel.accelerator", "is_bitsandbytes_multi_backend_available"),
    ("accel.accelerator", "is_xpu_available"),
]


@pytest.mark.parametrize(("module", "name"), ACCELERATE_TEST_PATCH_POINTS)
def test_the_names_accelerates_tests_reach_for_are_where_they_look(module: str, name: str) -> None:
    assert callable(getattr(importlib.import_module(module), name))
