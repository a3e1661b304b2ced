"""One call from a transformers model folder to a dispatched model: :func:`load_pretrained`.

transformers' ``from_pretrained(device_map=...)`` needs the ``accelerate`` distribution. This
module gives an ``accel-bigmodel`` user the same result from the folder ``save_pretrained``
wrote: the configuration is read through transformers, the model is built on the meta device
(no memory), a device map is planned with the model's own ``_no_split_modules`` and tied
weights, the weights stream from the folder's checkpoint (CPU weights of a safetensors
checkpoint are zero-copy views of the files, disk weights are read in place: nothing is written)
and the prefetching offload engine is installed. transformers is imported only when the
function runs.
"""

from __future__ import annotations

import collections
import importlib
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .dispatch import dispatch_planned, plan_devices
from .empty_init import init_empty_weights
from .loading import load_checkpoint
from .loading.files import checkpoint_files, is_safetensors, torch_load
from .loading.plan import LoadOptions, MissingWeightsError
from .prefetch import page_in_background, resolve_prefetch_depth
from .safetensors_files import SafetensorsFile
from .tensors import DeviceLike, parse_dtype

__all__ = ["PRETRAINED_WEIGHT_FILES", "load_pretrained"]

#: The weight files looked for in a model folder, in order of preference (safetensors first).
PRETRAINED_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)

_EXTRA = 'pip install "accel-bigmodel[transformers]"'


def _transformers() -> Any:
    try:
        return importlib.import_module("transformers")
    except ImportError as error:
        raise ImportError(
            "load_pretrained reads the model's config.json and builds its class through "
            f"transformers, which is not installed: {_EXTRA} (or pip install transformers). "
            "Without transformers, build the model yourself under init_empty_weights() and "
            "call load_checkpoint_and_dispatch."
        ) from error


def _check_folder(folder: str | os.PathLike[str]) -> Path:
    path = Path(os.fspath(folder))
    if not path.is_dir():
        hint = ""
        text = os.fspath(folder)
        if text.count("/") == 1 and not path.exists():
            hint = (
                f" If {text!r} is a Hugging Face Hub id, download it first (e.g. `hf download "
                f"{text} --local-dir <folder>`) and pass the folder: load_pretrained never "
                "goes to the network."
            )
        raise FileNotFoundError(
            f"load_pretrained(folder={text!r}): no such folder. Pass the folder that "
            f"save_pretrained wrote (config.json and the weights).{hint}"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"load_pretrained(folder={os.fspath(folder)!r}): the folder holds no config.json. "
            "Pass the folder that save_pretrained wrote; for a bare checkpoint, build the model "
            "under init_empty_weights() and call load_checkpoint_and_dispatch."
        )
    return path


def _weights_of(path: Path) -> str:
    for name in PRETRAINED_WEIGHT_FILES:
        if (path / name).is_file():
            return str(path / name)
    raise FileNotFoundError(
        f"load_pretrained(folder={str(path)!r}): the folder has a config.json but no weights: "
        f"expected one of {', '.join(PRETRAINED_WEIGHT_FILES)}. Save the model with "
        "save_pretrained (safetensors is its default)."
    )


def _resolve_class(transformers: Any, config: Any, model_class: Any) -> Any:
    """The class to build: ``model_class`` (a class or its name) or the first architecture."""
    if model_class is None:
        architectures = list(getattr(config, "architectures", None) or [])
        if not architectures:
            raise ValueError(
                "load_pretrained: config.json names no architecture (its 'architectures' list "
                "is empty), so the model class is unknown: pass model_class=..., e.g. "
                "transformers.AutoModelForCausalLM or the model's own class."
            )
        model_class = architectures[0]
    if isinstance(model_class, str):
        found = getattr(transformers, model_class, None)
        if found is None:
            raise ValueError(
                f"load_pretrained: transformers {transformers.__version__} has no class "
                f"{model_class!r} (custom modelling code is not run: trust_remote_code is not "
                "supported). Pass model_class=<the class> imported from your own code, or "
                "update transformers."
            )
        return found
    if not isinstance(model_class, type):
        raise TypeError(
            f"load_pretrained(model_class={model_class!r}): pass a model class (e.g. "
            "transformers.LlamaForCausalLM or AutoModelForCausalLM), its name, or None to use "
            "the config's architectures."
        )
    return model_class


def _checkpoint_dtype(files: Sequence[str], config: Any) -> torch.dtype:
    """The floating-point dtype holding most of the checkpoint's bytes (``dtype="auto"``)."""
    weight: collections.Counter[torch.dtype] = collections.Counter()
    for path in files:
        if is_safetensors(path):
            with SafetensorsFile(path) as handle:
                for name in handle.keys():
                    dtype = handle.dtype(name)
                    if dtype.is_floating_point:
                        numel = 1
                        for size in handle.shape(name):
                            numel *= size
                        weight[dtype] += numel * dtype.itemsize
        else:
            for value in torch_load(path).values():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    weight[value.dtype] += value.numel() * value.element_size()
    if weight:
        return weight.most_common(1)[0][0]
    configured = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    parsed = parse_dtype(configured) if configured not in (None, "auto") else None
    return parsed or torch.float32


def _checkpoint_keys(files: Sequence[str]) -> set[str]:
    keys: set[str] = set()
    for path in files:
        if is_safetensors(path):
            with SafetensorsFile(path) as handle:
                keys.update(handle.keys())
        else:
            keys.update(torch_load(path))
    return keys


def _build(transformers: Any, cls: Any, config: Any, dtype: torch.dtype, **kwargs: Any) -> Any:
    """Build ``cls`` from ``config`` on the meta device, in ``dtype``."""
    major = int(str(transformers.__version__).split(".", 1)[0])
    dtype_arg = {"dtype" if major >= 5 else "torch_dtype": dtype}
    with init_empty_weights():
        if hasattr(cls, "_model_mapping"):  # an Auto class: it picks the class for the config
            model = cls.from_config(config, **dtype_arg, **kwargs)
        else:
            model = cls._from_config(config, **dtype_arg, **kwargs)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"load_pretrained: {cls.__name__} built a {type(model).__name__}, not a "
            "torch.nn.Module: pass model_class=<a PyTorch model class>."
        )
    return model


def _patterns(model: nn.Module, attribute: str) -> list[re.Pattern[str]]:
    return [re.compile(text) for text in getattr(model, attribute, None) or ()]


def _renamer(model: nn.Module, checkpoint_keys: set[str]) -> Callable[[str], str | None]:
    """Map checkpoint keys onto the model's names, as transformers does.

    A checkpoint saved from the base model (no ``base_model_prefix.`` in its keys) loads into a
    model with a head, and one saved from a model with a head loads into the base model (its
    head's keys are then unexpected). Keys the model class says to ignore
    (``_keys_to_ignore_on_load_unexpected``) and values of buffers the model does not save
    are left out without a warning.
    """
    model_keys = set(model.state_dict().keys())
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    dotted = f"{prefix}."
    add = strip = False
    if prefix:
        has_base = isinstance(getattr(model, prefix, None), nn.Module)  # a model with a head
        model_prefixed = any(key.startswith(dotted) for key in model_keys)
        checkpoint_prefixed = any(key.startswith(dotted) for key in checkpoint_keys)
        add = has_base and model_prefixed and not checkpoint_prefixed
        strip = not has_base and checkpoint_prefixed and not model_prefixed
    ignored = _patterns(model, "_keys_to_ignore_on_load_unexpected")
    # Buffers the model does not save (position ids...) that old checkpoints still hold.
    unsaved = {name for name, _ in model.named_buffers()} - model_keys

    def rename(key: str) -> str | None:
        name = key
        if add and f"{dotted}{key}" in model_keys:
            name = f"{dotted}{key}"
        elif strip and key.startswith(dotted):
            name = key[len(dotted) :]
        if name in unsaved or (
            name not in model_keys and any(pattern.search(key) for pattern in ignored)
        ):
            return None
        return name

    return rename


def _file_maps(files: Sequence[str]) -> list[tuple[int, int, str]]:
    """``(start, end, path)`` of this process's memory maps of ``files`` (Linux; else [])."""
    wanted = {os.path.realpath(path) for path in files}
    maps: list[tuple[int, int, str]] = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].strip() in wanted:
                    low, high = (int(x, 16) for x in parts[0].split("-"))
                    maps.append((low, high, parts[5].strip()))
    except OSError:
        return []
    return maps


def _mapped_weights(model: nn.Module, files: Sequence[str]) -> list[tuple[int, int, str]]:
    """The CPU weights that are views of the checkpoint's files, in the model's order.

    An embedding table is left out unless it is tied to another weight (a forward reads only
    the rows of its tokens; a tied output layer reads it all).
    """
    maps = _file_maps(files)
    if not maps:
        return []
    uses = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    lookups = {
        id(module.weight)
        for module in model.modules()
        if isinstance(module, nn.Embedding) and uses[id(module.weight)] == 1
    }
    spans: list[tuple[int, int, str]] = []
    for param in model.parameters():
        if param.device.type != "cpu" or id(param) in lookups:
            continue
        address = param.data_ptr()
        for low, high, mapped in maps:
            if low <= address < high:
                spans.append((address, param.numel() * param.element_size(), mapped))
                break
    return spans


def _load_weights(model: nn.Module, config: Any, weights: str, options: LoadOptions) -> None:
    """Stream ``weights`` into ``model``; a missing weight names the class to build instead."""
    try:
        load_checkpoint(model, weights, options)
    except MissingWeightsError as error:
        saved_as = list(getattr(config, "architectures", None) or [])
        raise RuntimeError(
            f"load_pretrained built {type(model).__name__}, whose weights are not all in "
            f"{weights} (saved from {saved_as or 'an unnamed architecture'}); accel does not "
            "initialise missing weights at random. Pass model_class= the class the checkpoint "
            f"was saved from. {error}"
        ) from error


def load_pretrained(  # noqa: PLR0913 - one keyword per loading option
    folder: str | os.PathLike[str],
    model_class: Any = None,
    *,
    device_map: str | Mapping[str, DeviceLike] = "auto",
    max_memory: Mapping[int | str, int | str] | None = None,
    dtype: str | torch.dtype | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    prefetch_depth: int | None = None,
    no_split_module_classes: Sequence[str] | None = None,
    offload_buffers: bool = False,
    attn_implementation: str | None = None,
) -> nn.Module:
    """Load a transformers model folder, spread over GPU, CPU and disk, ready for ``generate``.

    The one-call form of ``config = AutoConfig.from_pretrained(folder)``,
    ``init_empty_weights()`` + ``from_config``, ``tie_weights()`` and
    ``load_checkpoint_and_dispatch``: what transformers' ``from_pretrained(device_map=...)``
    does with Accelerate installed. The model is built on the meta device; the device map is
    planned with the class's ``_no_split_modules`` (tied weights stay together); the weights
    stream from ``model.safetensors`` (or its sharded index; ``pytorch_model.bin`` only when
    no safetensors file is there). CPU weights of a safetensors checkpoint in their own dtype
    are zero-copy views of the files, and disk-mapped ones are read in place by the offload
    engine, which loads ``prefetch_depth`` blocks ahead: nothing is written to disk. The CPU
    weights are paged in by a background thread, in the model's order, so that the first
    forward does not wait on page faults (a warm page cache makes this a no-op). The
    folder's ``generation_config.json`` becomes ``model.generation_config``. The model is
    returned in eval mode, with ``model.hf_device_map`` set.

    Args:
        folder: the folder ``save_pretrained`` wrote (``config.json`` and the weights); a
            local path only (nothing is downloaded).
        model_class: the class to build: a transformers model class, an Auto class (e.g.
            ``AutoModelForCausalLM``), a class name in transformers, or ``None`` for the
            first of the config's ``architectures``.
        device_map: ``"auto"``, ``"balanced"``, ``"balanced_low_0"``, ``"sequential"`` or
            ``{module name: device}`` (devices: GPU index, ``"cpu"``, ``"disk"``, ...).
        max_memory: ``{device: budget}`` for the planner (``{0: "10GiB", "cpu": "2GiB"}``);
            default: this machine's free memory.
        dtype: the dtype of the floating-point weights; ``None`` or ``"auto"`` keeps the
            checkpoint's (what keeps CPU weights zero-copy). Converting disk-mapped weights
            needs ``offload_folder``.
        offload_folder: where disk-mapped weights are written when they must be (a
            ``pytorch_model.bin`` checkpoint, or a ``dtype`` change).
        prefetch_depth: offloaded blocks loaded ahead of the running one (``0``: load each
            when it starts); default ``ACCEL_OFFLOAD_PREFETCH_DEPTH``, else 1.
        no_split_module_classes: class names kept whole on one device; default: the model's
            ``_no_split_modules``.
        offload_buffers: offload the buffers of offloaded blocks too.
        attn_implementation: passed to the model's construction (``"eager"``, ``"sdpa"``...).

    Returns:
        The model, dispatched, in eval mode.

    Raises:
        ImportError: transformers is not installed (the message gives the pip command).
        FileNotFoundError: ``folder`` is not a folder, or lacks ``config.json`` or weights.
        ValueError: no model class can be found, a bad ``dtype``, ``device_map`` or
            ``prefetch_depth``, a checkpoint that does not fit the model's shapes, or
            disk-mapped weights that must be written without ``offload_folder``.
        RuntimeError: the checkpoint lacks weights the model needs (named); the model would
            otherwise run with uninitialised weights.
    """
    depth = resolve_prefetch_depth(prefetch_depth)
    path = _check_folder(folder)
    wanted_dtype = None if dtype in (None, "auto") else parse_dtype(dtype)
    if device_map is None:
        raise ValueError(
            "load_pretrained(device_map=None): pass 'auto' (the default), 'balanced', "
            "'balanced_low_0', 'sequential' or {module name: device}."
        )
    weights = _weights_of(path)
    files = checkpoint_files(weights)
    transformers = _transformers()
    config = transformers.AutoConfig.from_pretrained(str(path))
    cls = _resolve_class(transformers, config, model_class)
    build_dtype = wanted_dtype or _checkpoint_dtype(files, config)
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = _build(transformers, cls, config, build_dtype, **extra)
    model.tie_weights()
    model.eval()

    no_split = list(
        no_split_module_classes
        if no_split_module_classes is not None
        else getattr(model, "_no_split_modules", None) or []
    )
    skip_keys = getattr(model, "_skip_keys_device_placement", None)
    # The one parse of device_map: loading, weight planning and the hooks all get this plan.
    plan = plan_devices(model, device_map, max_memory, no_split, None, offload_buffers)
    assert plan is not None
    options = LoadOptions(
        plan=plan,
        offload_folder=offload_folder,
        dtype=wanted_dtype,
        offload_state_dict=plan.has_disk,
        offload_buffers=offload_buffers,
        keep_in_fp32_modules=list(getattr(model, "_keep_in_fp32_modules", None) or []),
        strict=False,
        rename=_renamer(model, _checkpoint_keys(files)),
        refuse_missing=True,
    )
    _load_weights(model, config, weights, options)
    model = dispatch_planned(
        model,
        plan,
        offload_dir=offload_folder,
        offload_buffers=offload_buffers,
        skip_keys=list(skip_keys) if skip_keys else None,
        prefetch_depth=depth,
    )
    page_in_background(_mapped_weights(model, files))
    generation_file = path / "generation_config.json"
    if generation_file.is_file() and hasattr(model, "generation_config"):
        model.generation_config = transformers.GenerationConfig.from_pretrained(str(path))
    return model
