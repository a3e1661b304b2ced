"""accel-bigmodel: run models larger than memory by spreading their layers over GPU, CPU and disk.

Meta-device initialisation, module sizes and device-map planning, streaming checkpoint loading,
the module-hook protocol, dispatch, CPU/disk offload (with a prefetching offload engine), and
``load_pretrained``: a transformers model folder to a dispatched model in one call.
Depends on accel-state, torch, safetensors and psutil only: ``pip install accel-bigmodel`` is
complete inference without the training stack. The names and signatures are Accelerate's
(``accelerate.big_modeling``, ``accelerate.hooks``, ``accelerate.utils.modeling`` and
``accelerate.utils.offload``).
"""

from __future__ import annotations

from .__about__ import __version__
from .casting import (
    SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING,
    LayerwiseCastingHook,
    attach_layerwise_casting_hooks,
)
from .device_map import (
    check_device_map,
    clean_device_map,
    fallback_allocate,
    get_module_leaves,
    infer_auto_device_map,
)
from .dispatch import (
    cpu_offload,
    cpu_offload_with_hook,
    disk_offload,
    dispatch_model,
    get_state_dict_from_offload,
    get_state_dict_offloaded_model,
    load_checkpoint_and_dispatch,
)
from .empty_init import init_empty_weights, init_on_device
from .hooks import (
    AlignDevicesHook,
    CpuOffload,
    ModelHook,
    SequentialHook,
    SynchronousMaterializer,
    UserCpuOffloadHook,
    WeightMaterializer,
    add_hook_to_module,
    align_module_device,
    attach_align_device_hook,
    attach_align_device_hook_on_blocks,
    attach_execution_device_hook,
    get_block_hooks,
    has_offloaded_params,
    remove_hook_from_module,
    remove_hook_from_submodules,
    set_weight_materializer,
)
from .loading import load_checkpoint_in_model
from .loading.files import load_state_dict
from .memory import get_balanced_memory, get_max_memory
from .offload import (
    OffloadedWeightsLoader,
    PrefixedDataset,
    WeightLocation,
    extract_submodules_state_dict,
    load_offloaded_weight,
    load_offloaded_weights,
    offload_state_dict,
    offload_weight,
    save_offload_index,
)
from .prefetch import PrefetchingMaterializer
from .pretrained import load_pretrained
from .safetensors_files import SafetensorsFile
from .sizes import (
    CustomDtype,
    calculate_maximum_sizes,
    compute_module_sizes,
    compute_module_total_buffer_size,
    convert_file_size_to_int,
    dtype_byte_size,
    get_max_layer_size,
    get_module_size_with_ties,
)
from .tensors import (
    check_device_same,
    check_tied_parameters_in_config,
    check_tied_parameters_on_same_device,
    clear_device_cache,
    find_tied_parameters,
    get_non_persistent_buffers,
    id_tensor_storage,
    named_module_tensors,
    retie_parameters,
    set_module_tensor_to_device,
)

__all__ = [
    "AlignDevicesHook",
    "CpuOffload",
    "CustomDtype",
    "LayerwiseCastingHook",
    "ModelHook",
    "OffloadedWeightsLoader",
    "PrefetchingMaterializer",
    "PrefixedDataset",
    "SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING",
    "SafetensorsFile",
    "SequentialHook",
    "SynchronousMaterializer",
    "UserCpuOffloadHook",
    "WeightLocation",
    "WeightMaterializer",
    "__version__",
    "add_hook_to_module",
    "align_module_device",
    "attach_align_device_hook",
    "attach_align_device_hook_on_blocks",
    "attach_execution_device_hook",
    "attach_layerwise_casting_hooks",
    "calculate_maximum_sizes",
    "check_device_map",
    "check_device_same",
    "check_tied_parameters_in_config",
    "check_tied_parameters_on_same_device",
    "clean_device_map",
    "clear_device_cache",
    "compute_module_sizes",
    "compute_module_total_buffer_size",
    "convert_file_size_to_int",
    "cpu_offload",
    "cpu_offload_with_hook",
    "disk_offload",
    "dispatch_model",
    "dtype_byte_size",
    "extract_submodules_state_dict",
    "fallback_allocate",
    "find_tied_parameters",
    "get_balanced_memory",
    "get_block_hooks",
    "get_max_layer_size",
    "get_max_memory",
    "get_module_leaves",
    "get_module_size_with_ties",
    "get_non_persistent_buffers",
    "get_state_dict_from_offload",
    "get_state_dict_offloaded_model",
    "has_offloaded_params",
    "id_tensor_storage",
    "infer_auto_device_map",
    "init_empty_weights",
    "init_on_device",
    "load_checkpoint_and_dispatch",
    "load_checkpoint_in_model",
    "load_offloaded_weight",
    "load_offloaded_weights",
    "load_pretrained",
    "load_state_dict",
    "named_module_tensors",
    "offload_state_dict",
    "offload_weight",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
    "retie_parameters",
    "save_offload_index",
    "set_module_tensor_to_device",
    "set_weight_materializer",
]
