"""A module's own tensors: naming them, moving one of them, tied parameters and device names.

Everything else in accel-bigmodel changes a model one tensor at a time through
:func:`set_module_tensor_to_device`, which keeps the parameter's class, its ``requires_grad``
and its attributes, checks the shape, and can reuse a copy of a tied weight already made on the
target device. :func:`parse_device` is the one place where a device written by a user (in a
device map, a ``max_memory`` key or an ``execution_device``) is validated.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from accel_state.devices import clear_device_cache

__all__ = [
    "DeviceLike",
    "check_device_available",
    "check_device_same",
    "check_tied_parameters_in_config",
    "check_tied_parameters_on_same_device",
    "clear_device_cache",
    "find_tied_parameters",
    "get_non_persistent_buffers",
    "id_tensor_storage",
    "named_module_tensors",
    "parse_device",
    "retie_parameters",
    "set_module_tensor_to_device",
]

logger = logging.getLogger(__name__)

DeviceLike = int | str | torch.device
"""A device as users write it: ``0``, ``"cuda:1"``, ``"cpu"``, ``"disk"``, ``torch.device(...)``."""

_DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu", "npu", "mlu", "musa", "hpu", "sdaa", "meta", "xla")
_ACCEPTED = (
    "an int GPU index (0, 1, ...), 'cpu', 'disk', 'meta', 'cuda', 'cuda:<index>', 'mps', "
    "'xpu:<index>', 'npu:<index>', or a torch.device"
)

Placement = torch.device | Literal["disk"]
"""Where a device map puts something once parsed: a ``torch.device`` or the string ``"disk"``."""

TiedParamsMap = dict[int, dict[Any, torch.Tensor]]


def placement_kind(placement: Placement) -> str:
    """``"disk"`` or the device type of a parsed placement (``"cpu"``, ``"cuda"``, ...)."""
    return "disk" if placement == "disk" else placement.type


def placement_key(placement: Placement) -> tuple[str, int | None]:
    """What identifies the device of a placement: its kind and, for accelerators, its index.

    ``cuda`` and ``cuda:0`` give one key; ``"disk"``, ``cpu``, ``meta`` and ``mps`` have no index.
    """
    if placement == "disk":
        return ("disk", None)
    if placement.type in ("cpu", "meta", "mps"):
        return (placement.type, None)
    return (placement.type, 0 if placement.index is None else placement.index)


def parse_device(value: Any, argument: str = "device") -> Placement:
    """Validate a device written by a user and return it as a ``torch.device`` (or ``"disk"``).

    Args:
        value: ``int`` (accelerator index), ``"disk"``, a device string or a ``torch.device``.
        argument: what the value was given as, for the error message (e.g. ``device_map['lm']``).

    Raises:
        ValueError: the value is not a device; the message lists the accepted forms.
    """
    if isinstance(value, torch.device):
        return value
    if isinstance(value, bool):
        raise ValueError(f"{argument}={value!r} is not a device: use {_ACCEPTED}.")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{argument}={value!r} is a negative device index: use {_ACCEPTED}.")
        return torch.device(_accelerator_type(), value)
    if isinstance(value, str):
        if value == "disk":
            return "disk"
        kind, _, index = value.partition(":")
        if kind in _DEVICE_TYPES and (not index or index.isdigit()):
            return torch.device(value)
    raise ValueError(f"{argument}={value!r} is not a device: use {_ACCEPTED}.")


def check_device_available(device: Placement, argument: str, fix: str | None = None) -> None:
    """Refuse a device this machine does not have, before anything is placed on it.

    ``"disk"``, ``cpu`` and ``meta`` are always there; an accelerator must be available with
    the index asked for. (``check_device_map`` checks only the form of a map, as Accelerate's
    does, so maps can be written and checked on another machine.)

    Args:
        device: the parsed device.
        argument: where it was given, for the message (e.g. ``device_map['lm']``).
        fix: what to do instead; default: use ``'cpu'``/``'disk'`` or ``device_map='auto'``.

    Raises:
        ValueError: naming the argument, the device and what this machine has.
    """
    if device == "disk" or device.type in ("cpu", "meta"):
        return
    if fix is None:
        fix = "use 'cpu' or 'disk' there, or device_map='auto' to fill the devices that exist"
    if device.type == "mps":
        available, count = torch.backends.mps.is_available(), 1
    else:
        backend = getattr(torch, device.type, None)
        if backend is None or not hasattr(backend, "is_available"):
            return  # a device type torch knows only through a plug-in (xla): left to it
        available = bool(backend.is_available())
        count = int(backend.device_count()) if available else 0
    if not available:
        raise ValueError(
            f"{argument} is {device}, but this machine has no {device.type} device "
            f"(torch.{device.type}.is_available() is False): {fix}"
        )
    if device.index is not None and device.index >= count:
        raise ValueError(
            f"{argument} is {device}, but this machine has {count} {device.type} device(s) "
            f"(indices 0 to {count - 1}): {fix}"
        )


def _accelerator_type() -> str:
    """The device type an int index refers to (CUDA unless only another accelerator exists)."""
    if torch.cuda.is_available():
        return "cuda"
    for kind in ("xpu", "npu", "mlu", "musa"):
        backend = getattr(torch, kind, None)
        if backend is not None and getattr(backend, "is_available", lambda: False)():
            return kind
    return "cuda"


def check_device_same(first_device: torch.device, second_device: torch.device) -> bool:
    """Whether two devices are the same one (``cuda`` and ``cuda:0`` are, when 0 is current)."""
    return same_device(torch.device(first_device), torch.device(second_device))


def same_device(first: torch.device, second: torch.device) -> bool:
    """Whether two parsed devices are one (``cuda`` and ``cuda:0`` are, when 0 is current)."""
    if first.type != second.type:
        return False
    if first.type in ("cpu", "meta") or first.index == second.index:
        return True
    # "cuda" and "cuda:0" name the same device when 0 is the current one.
    indexes = {first.index, second.index}
    return None in indexes and 0 in indexes


def named_module_tensors(
    module: nn.Module,
    include_buffers: bool = True,
    recurse: bool = False,
    remove_non_persistent: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for the parameters, then the buffers, of ``module``.

    Args:
        module: the module to read.
        include_buffers: also yield buffers.
        recurse: include the tensors of every submodule (dotted names), not only direct ones.
        remove_non_persistent: skip buffers registered with ``persistent=False``.
    """
    yield from module.named_parameters(recurse=recurse)
    if not include_buffers:
        return
    skipped: set[str] = set()
    if remove_non_persistent:
        skipped = get_non_persistent_buffers(module, recurse=recurse, fqns=recurse)
    for name, buffer in module.named_buffers(recurse=recurse):
        if name not in skipped:
            yield name, buffer


def get_non_persistent_buffers(
    module: nn.Module, recurse: bool = False, fqns: bool = False
) -> set[str]:
    """Names of the buffers of ``module`` registered with ``persistent=False``.

    Args:
        module: the module to read.
        recurse: include every submodule's non-persistent buffers.
        fqns: with ``recurse``, return dotted names relative to ``module`` (e.g.
            ``"rotary.inv_freq"``) instead of the bare buffer names.
    """
    names = set(module._non_persistent_buffers_set)
    if recurse:
        for prefix, child in module.named_modules():
            for name in child._non_persistent_buffers_set:
                names.add(f"{prefix}.{name}" if fqns and prefix else name)
    return names


def id_tensor_storage(tensor: torch.Tensor) -> tuple[torch.device, int, int]:
    """Identify the storage behind ``tensor``: two tensors sharing memory give the same triple.

    Returns ``(device, storage pointer, storage size in bytes)``; meta tensors (which have no
    storage) give their ``id`` as the pointer so distinct meta tensors stay distinct.
    """
    if tensor.device.type == "meta":
        return tensor.device, id(tensor), 0
    storage = tensor.untyped_storage()
    return tensor.device, storage.data_ptr(), storage.nbytes()


def _owner(module: nn.Module, tensor_name: str) -> tuple[nn.Module, str]:
    """The submodule holding ``tensor_name`` (a dotted path) and the tensor's own name."""
    *path, leaf = tensor_name.split(".")
    owner = module
    walked: list[str] = []
    for part in path:
        child = getattr(owner, part, None)
        walked.append(part)
        if not isinstance(child, nn.Module):
            raise ValueError(
                f"tensor_name={tensor_name!r}: the model has no submodule "
                f"{'.'.join(walked)!r}; give the dotted name of a parameter or buffer, as in "
                "model.state_dict().keys()."
            )
        owner = child
    if leaf not in owner._parameters and leaf not in owner._buffers:
        raise ValueError(
            f"tensor_name={tensor_name!r}: {type(owner).__name__} has no parameter or buffer "
            f"named {leaf!r} (it has {sorted([*owner._parameters, *owner._buffers])})."
        )
    return owner, leaf


def module_tensor(module: nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer ``name`` (dotted) of ``module``; ``KeyError`` when absent."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    tensor: torch.Tensor | None = owner._parameters.get(leaf)
    if tensor is None:
        tensor = owner._buffers.get(leaf)
    if tensor is None:
        raise KeyError(name)
    return tensor


def castable(dtype: torch.dtype) -> bool:
    """Whether a checkpoint value of this dtype follows the model's dtype (floats do)."""
    return dtype.is_floating_point or dtype.is_complex


def set_module_tensor_to_device(  # noqa: PLR0913 - Accelerate's signature
    module: nn.Module,
    tensor_name: str,
    device: DeviceLike,
    value: torch.Tensor | None = None,
    dtype: str | torch.dtype | None = None,
    fp16_statistics: torch.Tensor | None = None,
    tied_params_map: TiedParamsMap | None = None,
    non_blocking: bool = False,
    clear_cache: bool = True,
) -> None:
    """Put the parameter or buffer ``tensor_name`` on ``device``, optionally with a new value.

    Unlike ``param.to(device)`` this replaces the tensor *inside* the module, keeping the
    parameter's class, ``requires_grad`` and instance attributes. A value moved to the device
    it already is on, in its own dtype, is not copied (a CPU value becomes the parameter's
    storage as it is).

    Args:
        module: the model (or any ancestor of the tensor's module).
        tensor_name: dotted name of the parameter or buffer, as in ``state_dict()``.
        device: where the tensor goes (``"meta"`` drops its data).
        value: the new value; required when the current tensor is on the meta device. A
            floating-point value is cast to the current tensor's dtype unless ``dtype`` is
            given; integer and bool values are never cast.
        dtype: cast a floating-point value (or, with ``device="meta"``, the meta tensor) to this.
        fp16_statistics: int8 quantisation statistics (bitsandbytes); accel-bigmodel does not
            quantise, so this must be ``None``.
        tied_params_map: ``{data_ptr of the source: {device: tensor already there}}`` shared
            by the tensors of one forward, so that tied weights are copied to a device once.
        non_blocking: asynchronous host-to-device copy where possible.
        clear_cache: empty the accelerator's cache after a move to an accelerator.

    Raises:
        ValueError: no such tensor, a meta tensor without ``value``, or a shape mismatch
            (the message names the tensor and both shapes; the module is left unchanged).
    """
    if fp16_statistics is not None:
        raise ValueError(
            "fp16_statistics is only used for bitsandbytes int8 weights, which accel-bigmodel "
            "does not load; pass fp16_statistics=None."
        )
    owner, leaf = _owner(module, tensor_name)
    target = parse_device(device, "device")
    if target == "disk":
        raise ValueError(
            f"device='disk' for {tensor_name!r}: a tensor cannot live on disk inside a module; "
            "offload it with offload_weight() and set the module tensor to 'meta'."
        )
    is_buffer = leaf in owner._buffers
    old = owner._buffers[leaf] if is_buffer else owner._parameters[leaf]
    if old is None:
        raise ValueError(
            f"tensor_name={tensor_name!r} is registered as None on {type(owner).__name__}; "
            "there is no tensor to move."
        )
    reused = _tied_copy(tied_params_map, value, old, target)
    if reused is not None:
        _store(owner, leaf, reused, is_buffer)
        return
    if old.device.type == "meta" and target.type != "meta" and value is None:
        raise ValueError(
            f"{tensor_name!r} is on the meta device and has no data: pass `value=` to put it "
            f"on {target}."
        )
    wanted = parse_dtype(dtype)
    with torch.no_grad():
        if value is not None:
            value = _checked_value(value, old, tensor_name)
            if castable(value.dtype):
                value = value.to(wanted if wanted is not None else old.dtype)
            new = value.to(target, non_blocking=non_blocking)
        else:
            new = old.to(target, non_blocking=non_blocking)
            if wanted is not None and target.type == "meta" and castable(old.dtype):
                new = new.to(wanted)
        if is_buffer:
            owner._buffers[leaf] = new
        else:
            param = owner._parameters[leaf]
            assert param is not None
            if value is not None or new is not old:
                owner._parameters[leaf] = _rebuild_parameter(param, new)
    if clear_cache and target.type not in ("cpu", "meta"):
        clear_device_cache()
    if tied_params_map is not None:
        stored = owner._buffers[leaf] if is_buffer else owner._parameters[leaf]
        if stored is not None:
            _remember_tied_copy(tied_params_map, (old, value), target, stored)


def _tied_copy(
    tied_params_map: TiedParamsMap | None,
    value: torch.Tensor | None,
    old: torch.Tensor,
    target: torch.device,
) -> torch.Tensor | None:
    """A copy on ``target`` already made of the new value, else of the current tensor."""
    if tied_params_map is None:
        return None
    if value is not None:
        reused = tied_params_map.get(value.data_ptr(), {}).get(target)
        if reused is not None:
            return reused
    if old.device.type == "meta":
        return None
    return tied_params_map.get(old.data_ptr(), {}).get(target)


def _remember_tied_copy(
    tied_params_map: TiedParamsMap,
    sources: tuple[torch.Tensor, torch.Tensor | None],
    target: torch.device,
    stored: torch.Tensor,
) -> None:
    """Record ``stored`` as the copy on ``target`` of each tied source tensor."""
    for source in sources:
        if source is not None and source.device.type != "meta":
            entry = tied_params_map.get(source.data_ptr())
            if entry is not None and target not in entry:
                entry[target] = stored


def _checked_value(value: Any, old: torch.Tensor, tensor_name: str) -> torch.Tensor:
    """``value`` as a tensor of ``old``'s shape; a shape mismatch raises Accelerate's error."""
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value)
    if tuple(value.shape) == tuple(old.shape):
        return value
    # Accelerate's wording (suites assert it verbatim); the leaf name, as there.
    leaf = tensor_name.rsplit(".", 1)[-1]
    problem = ValueError(
        f'Trying to set a tensor of shape {value.shape} in "{leaf}" (which has '
        f"shape {old.shape}), this looks incorrect."
    )
    if sys.version_info >= (3, 11):  # the full name, in a note tracebacks show
        problem.add_note(
            f"{tensor_name!r} has shape {tuple(old.shape)}; the value given has "
            f"shape {tuple(value.shape)}. Nothing was changed."
        )
    raise problem


def _rebuild_parameter(param: torch.Tensor, data: torch.Tensor) -> nn.Parameter:
    """A parameter of ``param``'s class around ``data``, with its requires_grad and attributes."""
    cls = type(param)
    attributes = dict(param.__dict__)
    if cls is nn.Parameter or not issubclass(cls, nn.Parameter):
        rebuilt = nn.Parameter(data, requires_grad=param.requires_grad)
    else:
        try:
            rebuilt = cls(data, requires_grad=param.requires_grad)
        except TypeError:
            rebuilt = nn.Parameter(data, requires_grad=param.requires_grad)
    for key, item in attributes.items():
        setattr(rebuilt, key, item)
    return rebuilt


def _store(owner: nn.Module, leaf: str, tensor: torch.Tensor, is_buffer: bool) -> None:
    if is_buffer:
        owner._buffers[leaf] = tensor
    elif isinstance(tensor, nn.Parameter):
        owner._parameters[leaf] = tensor
    else:
        param = owner._parameters[leaf]
        assert param is not None
        owner._parameters[leaf] = _rebuild_parameter(param, tensor)


def dtype_named(name: str) -> torch.dtype | None:
    """The torch dtype called ``name`` (``"float16"`` or ``"torch.float16"``), else ``None``."""
    candidate = getattr(torch, name.replace("torch.", ""), None)
    return candidate if isinstance(candidate, torch.dtype) else None


def parse_dtype(value: str | torch.dtype | None, argument: str = "dtype") -> torch.dtype | None:
    """Turn ``"float16"``/``"torch.float16"`` into ``torch.float16``; dtypes and ``None`` pass.

    Checkpoint loading and ``load_pretrained`` parse their ``dtype=`` with it; the size
    planner's ``_resolve_dtype`` (sizes.py) shares its name lookup.

    Args:
        value: a ``torch.dtype``, its name with or without ``"torch."``, or ``None``.
        argument: the argument's name, for the error message.

    Raises:
        ValueError: ``value`` names no torch dtype (or is neither a string nor a dtype).
    """
    if value is None or isinstance(value, torch.dtype):
        return value
    found = dtype_named(value) if isinstance(value, str) else None
    if found is not None:
        return found
    raise ValueError(
        f"{argument}={value!r} is not a torch dtype: use e.g. torch.float16, 'float16' or "
        "'torch.bfloat16'."
    )


def find_tied_parameters(model: nn.Module, **_: Any) -> list[list[str]]:
    """Groups of parameter names that are the same ``Parameter`` object (tied weights).

    Each group is sorted; groups come in the order their first name appears in the model.
    Example: ``[["lm_head.weight", "embed.weight"]]`` becomes
    ``[["embed.weight", "lm_head.weight"]]``.
    """
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    tied = [sorted(names) for names in groups.values() if len(names) > 1]
    return tied


def retie_parameters(model: nn.Module, tied_params: Sequence[Sequence[str]]) -> None:
    """Make every name of each tied group point at one parameter again.

    The first parameter of a group that is not on the meta device wins (loading may have given
    each name its own copy, or left some on meta); when every member is on meta (all of them
    offloaded) the first one wins, so the names still share one parameter.
    """
    for group in tied_params:
        chosen: torch.Tensor | None = None
        for name in group:
            owner, leaf = _owner(model, name)
            param = getattr(owner, leaf)
            if param is not None and param.device.type != "meta":
                chosen = param
                break
        if chosen is None and group:
            owner, leaf = _owner(model, group[0])
            chosen = getattr(owner, leaf)
        if chosen is None:
            continue
        for name in group:
            owner, leaf = _owner(model, name)
            setattr(owner, leaf, chosen)


def check_tied_parameters_in_config(model: nn.Module) -> bool:
    """Whether a (HuggingFace transformers) model's configuration says some weights are tied.

    Checks ``tie_word_embeddings`` (with output embeddings present), ``tie_encoder_decoder``
    and modules defining ``_tie_weights``; any other model gives ``False``.
    """
    if "PreTrainedModel" not in [cls.__name__ for cls in inspect.getmro(type(model))]:
        return False
    config = getattr(model, "config", None)
    decoder_config = config
    if config is not None and hasattr(config, "get_text_config"):
        decoder_config = config.get_text_config(decoder=True)
    word_embeddings = bool(
        decoder_config is not None
        and getattr(decoder_config, "tie_word_embeddings", False)
        and model.get_output_embeddings()  # type: ignore[operator]
    )
    encoder_decoder = bool(
        config is not None
        and getattr(config, "is_encoder_decoder", False)
        and getattr(config, "tie_encoder_decoder", False)
    )
    tied_module = any(hasattr(child, "_tie_weights") for child in model.modules())
    return word_embeddings or encoder_decoder or tied_module


def longest_prefix(name: str, mapping: Mapping[str, Any]) -> str | None:
    """The key of ``mapping`` that is the longest dotted prefix of ``name``, or ``None``.

    ``""`` is a prefix of every name. This is how a device map places a tensor.
    """
    candidate = name
    while True:
        if candidate in mapping:
            return candidate
        if not candidate:
            return None
        candidate = candidate.rpartition(".")[0]


def _placement_of(name: str, device_map: Mapping[str, Any]) -> Any:
    key = longest_prefix(name, device_map)
    if key is None:
        raise ValueError(
            f"device_map does not place {name!r}: add an entry for it or one of its parent "
            "modules (or '' for the whole model)."
        )
    return device_map[key]


def check_tied_parameters_on_same_device(
    tied_params: Sequence[Sequence[str]], device_map: Mapping[str, Any]
) -> None:
    """Warn when the members of a tied group are placed on different devices by ``device_map``."""
    for group in tied_params:
        devices = {name: _placement_of(name, device_map) for name in group}
        if len({str(device) for device in devices.values()}) > 1:
            logger.warning(
                "Tied parameters are on different devices: %s. Put them on one device in your "
                "device_map (or use device_map='auto'); otherwise each device holds its own "
                "copy and they are no longer tied.",
                devices,
            )
