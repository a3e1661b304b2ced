"""The Accelerate-compatible import surface of ``accel``.

``accel``, ``accel.utils`` and the thin modules (``accel.state``, ``accel.data_loader``,
``accel.optimizer``, ``accel.scheduler``, ``accel.logging``, ``accel.launchers``,
``accel.big_modeling``, ``accel.hooks``) export exactly the names listed
here, and every one of them is the sibling package's own object, never a copy or a wrapper.
"""

from __future__ import annotations

import functools
import importlib
import logging
import subprocess
import sys
from types import ModuleType

import pytest

import accel
import accel.big_modeling
import accel.data_loader
import accel.hooks
import accel.launchers
import accel.logging
import accel.optimizer
import accel.scheduler
import accel.state
import accel.utils
import accel_amp
import accel_bigmodel
import accel_data
import accel_launch
import accel_state
from accel import (
    checkpointing,
    engine_plugins,
    handlers,
    memory,
    model_files,
    models,
    parallelism_config,
)
from accel.accelerator import Accelerator
from accel_launch import config as launch_config
from accel_launch import launchers as launch_launchers
from accel_state import imports as state_imports
from accel_state import structures as state_structures
from accel_state import topology as state_topology

EXPECTED_ACCEL = [
    "Accelerator",
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "ParallelismConfig",
    "PartialState",
    "ProfileKwargs",
    "__version__",
    "cpu_offload",
    "cpu_offload_with_hook",
    "debug_launcher",
    "disk_offload",
    "dispatch_model",
    "find_executable_batch_size",
    "infer_auto_device_map",
    "init_empty_weights",
    "init_on_device",
    "is_rich_available",
    "load_checkpoint_and_dispatch",
    "load_checkpoint_in_model",
    "notebook_launcher",
    "skip_first_batches",
    "synchronize_rng_states",
]

EXPECTED_UTILS = [
    "AORecipeKwargs",
    "AutocastKwargs",
    "BaseEnum",
    "CPUInformation",
    "CannotPadNestedTensorWarning",
    "ComputeEnvironment",
    "ConvertOutputsToFp32",
    "CustomDtype",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DeepSpeedSequenceParallelConfig",
    "DistributedDataParallelKwargs",
    "DistributedOperationException",
    "DistributedType",
    "DynamoBackend",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "LoggerType",
    "MODEL_NAME",
    "MegatronLMPlugin",
    "OPTIMIZER_NAME",
    "OffloadedWeightsLoader",
    "ParallelismConfig",
    "PrecisionType",
    "PrefixedDataset",
    "PrepareForLaunch",
    "ProfileKwargs",
    "ProjectConfiguration",
    "RNGType",
    "RNG_STATE_NAME",
    "SAFE_MODEL_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "SAFE_WEIGHTS_PATTERN_NAME",
    "SCALER_NAME",
    "SCHEDULER_NAME",
    "SageMakerDistributedType",
    "TensorInformation",
    "TorchContextParallelConfig",
    "TorchDynamoPlugin",
    "TorchTensorParallelConfig",
    "TorchTensorParallelPlugin",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "WEIGHTS_PATTERN_NAME",
    "align_module_device",
    "broadcast",
    "broadcast_object_list",
    "calculate_maximum_sizes",
    "check_device_map",
    "check_tied_parameters_in_config",
    "check_tied_parameters_on_same_device",
    "clean_device_map",
    "clean_state_dict_for_safetensors",
    "clear_device_cache",
    "clear_environment",
    "compare_versions",
    "compute_module_sizes",
    "compute_module_total_buffer_size",
    "concatenate",
    "convert_dict_to_env_variables",
    "convert_file_size_to_int",
    "convert_outputs_to_fp32",
    "convert_to_fp32",
    "copy_tensor_to_devices",
    "dtype_byte_size",
    "extract_model_from_parallel",
    "extract_submodules_state_dict",
    "find_batch_size",
    "find_device",
    "find_executable_batch_size",
    "find_tied_parameters",
    "gather",
    "gather_object",
    "get_balanced_memory",
    "get_cpu_distributed_information",
    "get_data_structure",
    "get_grad_scaler",
    "get_int_from_env",
    "get_max_layer_size",
    "get_max_memory",
    "get_mixed_precision_context_manager",
    "get_module_size_with_ties",
    "get_non_persistent_buffers",
    "get_shape",
    "get_state_dict_offloaded_model",
    "has_offloaded_params",
    "honor_type",
    "id_tensor_storage",
    "ignorant_find_batch_size",
    "infer_auto_device_map",
    "initialize_tensors",
    "is_aim_available",
    "is_bf16_available",
    "is_clearml_available",
    "is_comet_ml_available",
    "is_compiled_module",
    "is_cuda_available",
    "is_datasets_available",
    "is_deepspeed_available",
    "is_dvclive_available",
    "is_mlflow_available",
    "is_mps_available",
    "is_msamp_available",
    "is_namedtuple",
    "is_npu_available",
    "is_numpy_available",
    "is_pandas_available",
    "is_peft_available",
    "is_port_in_use",
    "is_rich_available",
    "is_swanlab_available",
    "is_tensor_information",
    "is_tensorboard_available",
    "is_torch_tensor",
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
    "listify",
    "load",
    "load_checkpoint_in_model",
    "load_offloaded_weight",
    "load_offloaded_weights",
    "load_state_dict",
    "named_module_tensors",
    "offload_state_dict",
    "offload_weight",
    "pad_across_processes",
    "pad_input_tensors",
    "parse_choice_from_env",
    "parse_flag_from_env",
    "patch_environment",
    "purge_accel_environment",
    "recursively_apply",
    "reduce",
    "release_memory",
    "retie_parameters",
    "save",
    "save_offload_index",
    "send_to_device",
    "set_module_tensor_to_device",
    "set_seed",
    "should_reduce_batch_size",
    "slice_tensors",
    "str_to_bool",
    "synchronize_rng_state",
    "synchronize_rng_states",
    "wait_for_everyone",
    "write_basic_config",
]

EXPECTED_THIN: dict[str, list[str]] = {
    "accel.state": [
        "AcceleratorState",
        "DistributedType",
        "GradientState",
        "PartialState",
        "is_initialized",
    ],
    "accel.data_loader": [
        "BatchSamplerShard",
        "DataLoaderDispatcher",
        "DataLoaderShard",
        "DataLoaderStateMixin",
        "IterableDatasetShard",
        "SeedableRandomSampler",
        "SkipBatchSampler",
        "SkipDataLoader",
        "get_sampler",
        "prepare_data_loader",
        "skip_first_batches",
    ],
    "accel.optimizer": ["AcceleratedOptimizer"],
    "accel.scheduler": ["AcceleratedScheduler"],
    "accel.logging": ["MultiProcessAdapter", "get_logger"],
    "accel.launchers": ["PrepareForLaunch", "debug_launcher", "notebook_launcher"],
    "accel.big_modeling": [
        "attach_layerwise_casting_hooks",
        "cpu_offload",
        "cpu_offload_with_hook",
        "disk_offload",
        "dispatch_model",
        "init_empty_weights",
        "init_on_device",
        "load_checkpoint_and_dispatch",
    ],
    "accel.hooks": [
        "AlignDevicesHook",
        "CpuOffload",
        "LayerwiseCastingHook",
        "ModelHook",
        "SequentialHook",
        "UserCpuOffloadHook",
        "add_hook_to_module",
        "attach_align_device_hook",
        "attach_align_device_hook_on_blocks",
        "attach_execution_device_hook",
        "remove_hook_from_module",
        "remove_hook_from_submodules",
    ],
}

# Where each re-exported name is defined: the sibling module whose object must come back.
_OWNERS: tuple[ModuleType, ...] = (
    accel_state,
    state_imports,
    state_structures,
    state_topology,
    accel_data,
    accel_amp,
    accel_bigmodel,
    accel_launch,
    launch_config,
    launch_launchers,
    handlers,
    memory,
    models,
    checkpointing,
    model_files,
    engine_plugins,
    parallelism_config,
)

# Names Accelerate exports that accel must not offer yet: they belong to packages written
# later or to engines accel does not implement.
NOT_YET = [
    "prepare_pippy",
]


def _owner_object(name: str) -> object:
    owners = [module for module in _OWNERS if name in vars(module)]
    assert owners, f"{name} is not defined by any sibling module"
    objects = {id(vars(module)[name]) for module in owners}
    assert len(objects) == 1, f"{name} means different objects in {owners}"
    return vars(owners[0])[name]


# --- (a) the exact lists ----------------------------------------------------------------------


def test_expected_lists_are_sorted_and_unique() -> None:
    for names in (EXPECTED_ACCEL, EXPECTED_UTILS, *EXPECTED_THIN.values()):
        assert names == sorted(names)
        assert len(set(names)) == len(names)


def test_accel_all() -> None:
    assert accel.__all__ == EXPECTED_ACCEL


def test_utils_all() -> None:
    assert accel.utils.__all__ == EXPECTED_UTILS


@pytest.mark.parametrize("module_name", sorted(EXPECTED_THIN))
def test_thin_module_all(module_name: str) -> None:
    module = importlib.import_module(module_name)
    assert module.__all__ == EXPECTED_THIN[module_name]
    assert module.__doc__


def test_not_yet_exported() -> None:
    for name in NOT_YET:
        assert name not in accel.__all__
        assert not hasattr(accel, name), name
        assert not hasattr(accel.utils, name), name


def test_purge_accelerate_environment_not_aliased() -> None:
    # accel's helper watches ACCEL_* variables, so it is only offered under its own name.
    assert accel.utils.purge_accel_environment is accel_state.purge_accel_environment
    assert not hasattr(accel.utils, "purge_accelerate_environment")


# --- (b) every name is the sibling's own object ------------------------------------------------


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


@pytest.mark.parametrize("name", EXPECTED_UTILS)
def test_utils_name_is_the_siblings_object(name: str) -> None:
    assert getattr(accel.utils, name) is _owner_object(name)


def test_utils_spot_checks() -> None:
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


@pytest.mark.parametrize(
    ("module_name", "owner"),
    [
        ("accel.state", accel_state),
        ("accel.data_loader", accel_data),
        ("accel.optimizer", accel_amp),
        ("accel.scheduler", accel_amp),
        ("accel.logging", accel_state),
        ("accel.launchers", accel_launch),
        ("accel.big_modeling", accel_bigmodel),
        ("accel.hooks", accel_bigmodel),
    ],
)
def test_thin_module_names_are_the_siblings_objects(module_name: str, owner: ModuleType) -> None:
    module = importlib.import_module(module_name)
    for name in EXPECTED_THIN[module_name]:
        assert getattr(module, name) is getattr(owner, name), f"{module_name}.{name}"


def test_shared_names_agree_across_modules() -> None:
    for name in set(EXPECTED_ACCEL) & set(EXPECTED_UTILS):
        assert getattr(accel, name) is getattr(accel.utils, name), name
    for module_name, names in EXPECTED_THIN.items():
        module = importlib.import_module(module_name)
        for name in set(names) & set(EXPECTED_ACCEL):
            assert getattr(module, name) is getattr(accel, name), f"{module_name}.{name}"


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
        "import accel\n"
        "heavy = ('deepspeed', 'torch_xla', 'tensorboard', 'torchao')\n"
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


@pytest.mark.parametrize("name", EXPECTED_ACCEL)
def test_from_accel_import(name: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"from accel import {name}", namespace)
    assert namespace[name] is getattr(accel, name)


@pytest.mark.parametrize("name", EXPECTED_UTILS)
def test_from_accel_utils_import(name: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"from accel.utils import {name}", namespace)
    assert namespace[name] is getattr(accel.utils, name)


def test_star_imports() -> None:
    for module_name in ("accel", "accel.utils", *EXPECTED_THIN):
        namespace: dict[str, object] = {}
        exec(f"from {module_name} import *", namespace)
        module = importlib.import_module(module_name)
        assert set(namespace) - {"__builtins__"} == set(module.__all__), module_name
