"""The offload folder format, the weight maps built on it, and the per-model offload registry.

An offload folder holds one raw, C-ordered memory-map file per tensor, ``<dotted.name>.dat``,
and an ``index.json`` mapping each name to ``{"dtype": ..., "shape": [...]}`` — the layout
Accelerate writes, so folders are interchangeable. ``bfloat16`` and ``float8_*`` tensors are
stored as their raw bits (the index keeps the real dtype name); a 0-d tensor is stored as one
element while its index shape stays ``[]``. Index entries may instead point into a safetensors
file (``{"safetensors_file": ..., "weight_name": ..., "dtype": ..., "shape": [...]}``): such
weights are read in place and never copied into the folder. The format itself (dtype names,
paths, reading and validating ``index.json``, checking an entry against its file and the model)
lives in :mod:`.offload_format`; this module writes folders and reads them.

:class:`OffloadedWeightsLoader` is the read side used by the hooks: a mapping from weight names
to CPU tensors that are zero-copy views (of a copy-on-write map of the safetensors file, or of the
``.dat`` file), with every file opened once per loader. Entries of an ``index.json`` read from
disk are confined to their folder: a name or file that would resolve outside it is refused
before anything is opened. :meth:`OffloadedWeightsLoader.check_serves` checks, from headers and
file sizes only, that an entry can fill a model tensor; dispatch and
:func:`load_offloaded_weights` call it for every weight before the model changes.

The registry (:func:`register_offload_index` / :func:`registered_offload_index`) remembers, per
model, the in-place entries that ``load_checkpoint_in_model`` recorded for disk-mapped weights of
a safetensors checkpoint, so that dispatch can serve them without an offload folder.
"""

from __future__ import annotations

import json
import math
import os
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from accel_state.files import atomic_write

from .offload_format import (
    INDEX_FILE,
    OffloadIndex,
    WeightInfo,
    check_dat_entry,
    check_fits,
    check_safetensors_entry,
    check_weight_name,
    dat_path,
    dtype_from_index,
    entry_layout,
    index_dtype_name,
    read_disk_index,
)
from .safetensors_files import SafetensorsFile, tensor_buffer
from .tensors import set_module_tensor_to_device

__all__ = [
    "OffloadedWeightsLoader",
    "PrefixedDataset",
    "WeightLocation",
    "extract_submodules_state_dict",
    "load_offloaded_weight",
    "load_offloaded_weights",
    "offload_state_dict",
    "offload_weight",
    "register_offload_index",
    "registered_offload_index",
    "save_offload_index",
]


def _not_an_entry(name: str, info: Any) -> str:
    return (
        f"index entry {name!r} is {info!r}, not a mapping: use {{'dtype': ..., 'shape': [...]}} "
        "(or 'safetensors_file'/'weight_name'), as offload_state_dict() writes them."
    )


# -- writing ------------------------------------------------------------------------------


def _check_weight(weight: Any, weight_name: str) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor):
        raise TypeError(
            f"weight for {weight_name!r} is a {type(weight).__name__}, not a torch.Tensor: "
            "only tensors can be offloaded."
        )
    if weight.device.type == "meta":
        raise ValueError(
            f"weight {weight_name!r} is on the meta device and has no data to offload: load its "
            "value first."
        )
    return weight


def offload_weight(
    weight: torch.Tensor,
    weight_name: str,
    offload_folder: str | os.PathLike[str],
    index: OffloadIndex | None = None,
) -> OffloadIndex | None:
    """Write one tensor to ``<offload_folder>/<weight_name>.dat`` in Accelerate's format.

    The file holds the tensor's raw bytes in C order (``bfloat16``/``float8`` as their bits, a
    0-d tensor as one element); it is written to a temporary file and renamed into place.

    Args:
        weight: the tensor (any device but meta).
        weight_name: its dotted name; becomes the file name.
        offload_folder: an existing folder.
        index: when given, ``index[weight_name]`` is set to ``{"dtype", "shape"}``.

    Returns:
        ``index`` (updated), or ``None`` when no index was passed.

    Raises:
        TypeError: ``weight`` is not a tensor.
        ValueError: ``weight`` is on meta, or ``weight_name`` contains a path separator.
    """
    name = check_weight_name(weight_name, offload_folder)
    tensor = _check_weight(weight, name)
    shape = list(tensor.shape)
    host = tensor.detach().to("cpu").contiguous()
    if host.dim() == 0:
        host = host.reshape(1)

    # numpy cannot map an empty file, so Accelerate's writer leaves one byte.
    data = tensor_buffer(host) if host.numel() else b"\x00"
    atomic_write(dat_path(offload_folder, name), data)
    if index is not None:
        index[name] = {"dtype": index_dtype_name(tensor.dtype), "shape": shape}
    return index


def _read_file_into(path: str, out: torch.Tensor) -> None:
    nbytes = out.numel() * out.element_size()
    if nbytes == 0:
        return
    buffer = tensor_buffer(out)
    with open(path, "rb") as stream:
        done = 0
        while done < nbytes:
            count = stream.readinto(buffer[done:])
            if not count:
                raise ValueError(
                    f"offloaded weight file {path} ends after {done} bytes but its index entry "
                    f"needs {nbytes}: the folder is incomplete; regenerate it."
                )
            done += count


def load_offloaded_weight(
    weight_file: str | os.PathLike[str], weight_info: WeightInfo
) -> torch.Tensor:
    """Read a tensor written by :func:`offload_weight` into a new CPU tensor.

    Args:
        weight_file: the ``.dat`` file.
        weight_info: its index entry, ``{"dtype": "float32", "shape": [..]}``.

    Raises:
        ValueError: the entry is malformed or the file is shorter than the entry says.
    """
    path = os.fspath(weight_file)
    dtype, shape = entry_layout(weight_info, path)
    out = torch.empty(shape, dtype=dtype)
    _read_file_into(path, out)
    return out


def save_offload_index(index: OffloadIndex | None, offload_folder: str | os.PathLike[str]) -> None:
    """Merge ``index`` into ``<offload_folder>/index.json`` (written atomically, indent 2).

    Nothing is written when ``index`` is ``None`` or empty.

    Raises:
        ValueError: an existing ``index.json`` is not a JSON object.
    """
    if not index:
        return
    folder = os.fspath(offload_folder)
    os.makedirs(folder, exist_ok=True)
    index_file = os.path.join(folder, INDEX_FILE)
    current: dict[str, Any] = {}
    if os.path.isfile(index_file):
        try:
            with open(index_file, encoding="utf-8") as handle:
                current = json.load(handle)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(
                f"cannot merge into {index_file}: it is not valid JSON ({err}); delete it or the "
                "whole offload folder and offload again."
            ) from None
        if not isinstance(current, dict):
            raise ValueError(
                f"cannot merge into {index_file}: it holds a JSON {type(current).__name__}, not "
                "an object; delete it or the whole offload folder and offload again."
            )
    current.update(index)
    atomic_write(index_file, json.dumps(current, indent=2))


def offload_state_dict(
    save_dir: str | os.PathLike[str], state_dict: Mapping[str, torch.Tensor]
) -> None:
    """Write every tensor of ``state_dict`` to ``save_dir`` and merge their entries into its index.

    All names and tensors are checked before the first file is written.

    Raises:
        TypeError: a value is not a tensor.
        ValueError: a tensor is on meta, or a name contains a path separator.
    """
    for name, tensor in state_dict.items():
        _check_weight(tensor, check_weight_name(name, save_dir))
    os.makedirs(save_dir, exist_ok=True)
    index: OffloadIndex = {}
    for name, tensor in state_dict.items():
        offload_weight(tensor, name, save_dir, index=index)
    save_offload_index(index, save_dir)


# -- reading through mappings -------------------------------------------------------------


class WeightLocation(NamedTuple):
    """Where the bytes of an offloaded weight live on disk.

    Attributes:
        path: the file holding them (a safetensors file or a ``.dat`` file).
        offset: the position of their first byte in the file.
        length: how many bytes they span (``> 0``).
    """

    path: str
    offset: int
    length: int


class PrefixedDataset(Mapping[str, Any]):
    """The entries of ``dataset`` whose keys start with ``prefix``, addressed without it.

    ``PrefixedDataset(weights, "layers.0.")["weight"]`` is ``weights["layers.0.weight"]``.
    Iteration yields the keys without the prefix.

    Args:
        dataset: any mapping with string keys.
        prefix: prepended to every key looked up.
    """

    def __init__(self, dataset: Mapping[str, Any], prefix: str) -> None:
        self.dataset = dataset
        self.prefix = prefix

    def __getitem__(self, key: str) -> Any:
        return self.dataset[f"{self.prefix}{key}"]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and f"{self.prefix}{key}" in self.dataset

    def weight_location(self, key: str) -> WeightLocation | None:
        """The file bytes behind ``key`` when the wrapped mapping can tell (else ``None``)."""
        locate = getattr(self.dataset, "weight_location", None)
        return None if locate is None else locate(f"{self.prefix}{key}")

    def mapped_bytes(self, key: str) -> torch.Tensor | None:
        """The mapped file bytes behind ``key`` if the wrapped mapping can tell (else ``None``)."""
        mapped = getattr(self.dataset, "mapped_bytes", None)
        return None if mapped is None else mapped(f"{self.prefix}{key}")

    def __iter__(self) -> Iterator[str]:
        start = len(self.prefix)
        return iter([key[start:] for key in self.dataset if key.startswith(self.prefix)])

    def __len__(self) -> int:
        return sum(1 for key in self.dataset if key.startswith(self.prefix))


class OffloadedWeightsLoader(Mapping[str, torch.Tensor]):
    """A mapping of weight names to tensors kept in memory, in an offload folder or in place.

    Lookups try ``state_dict`` first, then the index: a ``safetensors_file`` entry is served as
    a zero-copy view of a copy-on-write map of that file (cast only when the entry asks for
    another dtype), a ``.dat`` entry as a zero-copy tensor over its file. Every file is opened
    once per loader and reused.

    Args:
        state_dict: tensors already in memory; they win over index entries of the same name.
        save_folder: the offload folder (``.dat`` files; also where ``index.json`` is read when
            ``index`` is not given).
        index: ``{name: entry}``; defaults to ``save_folder/index.json``. Entries read from disk
            must name files inside ``save_folder``.
        device: move index-served tensors there (default: leave them on the CPU).

    Raises:
        ValueError: none of ``state_dict``, ``save_folder``, ``index`` was given; an on-disk
            index entry leaves its folder; ``.dat`` entries exist but there is no
            ``save_folder``.
        FileNotFoundError: ``save_folder`` has no ``index.json`` and no ``index`` was given.
    """

    def __init__(
        self,
        state_dict: Mapping[str, torch.Tensor] | None = None,
        save_folder: str | os.PathLike[str] | None = None,
        index: Mapping[str, WeightInfo] | None = None,
        device: Any = None,
    ) -> None:
        if state_dict is None and save_folder is None and index is None:
            raise ValueError(
                "OffloadedWeightsLoader needs at least one of state_dict=, save_folder= or "
                "index=; got none of them."
            )
        self.state_dict: Mapping[str, torch.Tensor] = {} if state_dict is None else state_dict
        self.save_folder = None if save_folder is None else os.fspath(save_folder)
        if index is None and self.save_folder is not None:
            index = read_disk_index(self.save_folder)
        self.index: dict[str, WeightInfo] = {} if index is None else dict(index)
        for name, info in self.index.items():
            if not isinstance(info, Mapping):
                raise ValueError(_not_an_entry(name, info))
            if info.get("safetensors_file") is None:
                check_weight_name(name, self.save_folder)
                if self.save_folder is None:
                    raise ValueError(
                        f"index entry {name!r} is a '.dat' offloaded weight but save_folder is "
                        "None: pass the offload folder as save_folder=."
                    )
        self.all_keys = list(self.state_dict.keys())
        known = set(self.all_keys)
        self.all_keys.extend(key for key in self.index if key not in known)
        self.device = device
        self._lock = threading.Lock()
        self._files: dict[str, SafetensorsFile] = {}
        self._maps: dict[str, torch.Tensor] = {}

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.state_dict:
            return self.state_dict[key]
        try:
            info = self.index[key]
        except KeyError:
            raise KeyError(key) from None
        if info.get("safetensors_file") is not None:
            tensor = self._safetensors_view(key, info)
        else:
            tensor = self._dat_view(key, info)
        if self.device is not None:
            tensor = tensor.to(self.device)
        return tensor

    def weight_location(self, key: str) -> WeightLocation | None:
        """Where the bytes of ``key`` are on disk, for readers that fetch them ahead of use.

        The prefetching offload engine uses this to page a block's weights in, and to check
        that their files are still there, before the block runs.

        Args:
            key: a weight name of this mapping.

        Returns:
            ``WeightLocation(path, offset, length)`` for a weight read from a safetensors file
            or a ``.dat`` file; ``None`` for a ``state_dict`` entry (already in memory) and for
            an empty tensor.

        Raises:
            KeyError: ``key`` is not in the mapping.
            FileNotFoundError: its file does not exist (any more).
        """
        if key in self.state_dict:
            return None
        try:
            info = self.index[key]
        except KeyError:
            raise KeyError(key) from None
        if info.get("safetensors_file") is not None:
            handle = self._safetensors_file(os.fspath(info["safetensors_file"]))
            start, end = handle.offsets(info.get("weight_name", key))
            if end == start:
                return None
            return WeightLocation(handle.path, start, end - start)
        dtype, shape = entry_layout(info, key)
        numel = math.prod(shape)
        if numel == 0:
            return None
        assert self.save_folder is not None
        return WeightLocation(dat_path(self.save_folder, key), 0, numel * dtype.itemsize)

    def mapped_bytes(self, key: str) -> torch.Tensor | None:
        """The bytes of ``key`` in this loader's memory map of its file, as a flat uint8 tensor.

        It is a zero-copy view over the same map that the tensors returned by ``loader[key]``
        view (creating the map if needed), so touching or paging in these bytes is what makes
        those tensors resident; holding it keeps the map alive. The file bytes are given as
        stored, before any dtype conversion the index asks for.

        Returns:
            The view, or ``None`` for a ``state_dict`` entry or an empty tensor.

        Raises:
            KeyError: ``key`` is not in the mapping.
        """
        if key in self.state_dict:
            return None
        try:
            info = self.index[key]
        except KeyError:
            raise KeyError(key) from None
        if info.get("safetensors_file") is not None:
            handle = self._safetensors_file(os.fspath(info["safetensors_file"]))
            tensor = handle.view(info.get("weight_name", key))
        else:
            tensor = self._dat_view(key, info)
        if tensor.numel() == 0:
            return None
        return tensor.reshape(-1).view(torch.uint8)

    def _safetensors_file(self, path: str) -> SafetensorsFile:
        with self._lock:
            handle = self._files.get(path)
            if handle is None:
                handle = SafetensorsFile(path)
                self._files[path] = handle
        return handle

    def _safetensors_view(self, key: str, info: Mapping[str, Any]) -> torch.Tensor:
        path = os.fspath(info["safetensors_file"])
        handle = self._safetensors_file(path)
        tensor = handle.view(info.get("weight_name", key))
        if "shape" in info and tuple(info["shape"]) != tuple(tensor.shape):
            raise ValueError(
                f"offload index entry {key!r} says shape {list(info['shape'])} but "
                f"{path} holds shape {list(tensor.shape)}: the index is stale; reload the "
                "checkpoint."
            )
        if info.get("dtype") is not None:
            wanted = dtype_from_index(info["dtype"], key)
            if wanted != tensor.dtype:
                tensor = tensor.to(wanted)
        return tensor

    def _dat_view(self, key: str, info: Mapping[str, Any]) -> torch.Tensor:
        with self._lock:
            base = self._maps.get(key)
            if base is None:
                base = self._map_dat(key, info)
                self._maps[key] = base
        return base.view(base.shape)

    def _map_dat(self, key: str, info: Mapping[str, Any]) -> torch.Tensor:
        assert self.save_folder is not None
        dtype, shape = entry_layout(info, key)
        numel = math.prod(shape)
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        path = dat_path(self.save_folder, key)
        needed = numel * dtype.itemsize
        size = os.path.getsize(path)
        if size < needed:
            raise ValueError(
                f"offloaded weight file {path} has {size} bytes but its index entry needs "
                f"{needed}: the folder is incomplete; regenerate it."
            )
        flat = torch.from_file(path, shared=False, size=numel, dtype=dtype)
        return flat.view(shape)

    def check_serves(self, key: str, target: torch.Tensor, name: str | None = None) -> None:
        """Check, reading no tensor data, that ``self[key]`` can be the value of ``target``.

        Dispatch and :func:`load_offloaded_weights` call this for every weight they will read,
        before the model changes, so that a damaged or stale offload folder is refused at once
        instead of at some later forward. The file behind an index entry must exist and hold
        exactly the bytes the entry describes (a safetensors file: the named tensor, with the
        entry's shape); the shape must be ``target``'s, and a floating-point value cannot stand
        for an integer tensor or the other way round (other dtypes are cast on load).

        Args:
            key: the name of the weight in this mapping.
            target: the model's tensor it will fill (usually on the meta device).
            name: the model's name of ``target`` when it differs from ``key`` (a tied alias).

        Raises:
            KeyError: ``key`` is not in the mapping.
            TypeError: a ``state_dict`` value is not a tensor.
            FileNotFoundError: the file an index entry points to does not exist.
            ValueError: a malformed entry, a file whose size or contents do not match its
                entry, or a shape or kind of dtype that does not match ``target``.
        """
        name = key if name is None else name
        if key in self.state_dict:
            value = self.state_dict[key]
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"state_dict[{key!r}] is a {type(value).__name__}, not a tensor: pass a "
                    "state dict of tensors (as model.state_dict() gives)."
                )
            layout = (tuple(value.shape), value.dtype, f"state_dict[{key!r}]")
        else:
            try:
                info = self.index[key]
            except KeyError:
                raise KeyError(key) from None
            if info.get("safetensors_file") is not None:
                layout = check_safetensors_entry(key, info, self._safetensors_file)
            else:
                assert self.save_folder is not None  # the constructor refuses it otherwise
                layout = check_dat_entry(key, info, self.save_folder)
        check_fits(layout, name, target)

    def __contains__(self, key: object) -> bool:
        return key in self.state_dict or key in self.index

    # A copy (``copy.deepcopy`` or pickle, e.g. of a dispatched model for an EMA or reference
    # model) gets the in-memory tensors and the index; it opens and maps its files afresh on
    # first use, so it shares no lock and no map with this loader.
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for private in ("_lock", "_files", "_maps"):
            state.pop(private, None)
        return state

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._files = {}
        self._maps = {}

    def __iter__(self) -> Iterator[str]:
        return iter(self.all_keys)

    def __len__(self) -> int:
        return len(self.all_keys)

    def close(self) -> None:
        """Forget the cached files (tensors already handed out stay valid)."""
        with self._lock:
            for handle in self._files.values():
                handle.close()
            self._files.clear()
            self._maps.clear()


def extract_submodules_state_dict(
    state_dict: Mapping[str, torch.Tensor], submodule_names: Sequence[str]
) -> dict[str, torch.Tensor]:
    """The entries of ``state_dict`` belonging to the named submodules.

    A key belongs to submodule ``m`` when it is ``m`` or starts with ``m.`` (so ``h.1`` does
    not take the keys of ``h.10``).
    """
    result: dict[str, torch.Tensor] = {}
    for module_name in submodule_names:
        prefix = f"{module_name}."
        for key, value in state_dict.items():
            if key == module_name or key.startswith(prefix):
                result[key] = value
    return result


def load_offloaded_weights(
    model: nn.Module, index: Mapping[str, WeightInfo] | None, offload_folder: str | os.PathLike[str]
) -> None:
    """Load every weight of ``index`` from ``offload_folder`` into ``model`` on the CPU.

    Each tensor is read into new memory (the model does not keep the files open). Every entry
    is checked first (its name is a tensor of ``model``, its file exists with the bytes the
    entry describes, its shape is the model's), so a bad index leaves the model unchanged.

    Raises:
        TypeError: ``index`` is not a mapping of entries.
        FileNotFoundError: a file an entry points to does not exist.
        ValueError: a malformed entry, a name that is not a tensor of ``model`` or that would
            leave the folder, a file or shape that does not match its entry or the model, or
            bitsandbytes 8-bit statistics (``*.SCB``), which accel-bigmodel does not load.
    """
    if index is None:
        return
    if not isinstance(index, Mapping):
        raise TypeError(
            f"index={index!r} has type {type(index).__name__}: pass the offload index, a dict "
            "{weight name: {'dtype': ..., 'shape': [...]}} (the contents of index.json)."
        )
    if not index:
        return
    for name, info in index.items():
        if "SCB" in name:
            raise ValueError(
                f"offload index entry {name!r} holds bitsandbytes int8 statistics; "
                "accel-bigmodel does not load 8-bit bitsandbytes weights. Load the model with "
                "transformers + bitsandbytes instead."
            )
        if not isinstance(info, Mapping):
            raise ValueError(_not_an_entry(name, info))
    targets: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    targets.update(model.named_buffers(remove_duplicate=False))
    unknown = [name for name in index if name not in targets]
    if unknown:
        shown = ", ".join(repr(name) for name in unknown[:8])
        raise ValueError(
            f"the offload index names {shown}{' ...' if len(unknown) > 8 else ''}, which "
            f"{type(model).__name__} has no parameter or buffer of: the index belongs to "
            "another model. Pass this model's offload folder (or remove those entries)."
        )
    loader = OffloadedWeightsLoader(index=index, save_folder=offload_folder)
    try:
        for name in index:
            loader.check_serves(name, targets[name])
        for name, info in index.items():
            if info.get("safetensors_file") is not None:
                handle = loader._safetensors_file(os.fspath(info["safetensors_file"]))
                value = handle.read(info.get("weight_name", name))
                if info.get("dtype") is not None:
                    value = value.to(dtype_from_index(info["dtype"], name))
            else:
                value = load_offloaded_weight(dat_path(offload_folder, name), dict(info))
            set_module_tensor_to_device(model, name, "cpu", value=value)
    finally:
        loader.close()


# -- per-model registry of in-place entries -----------------------------------------------

_REGISTRY: weakref.WeakKeyDictionary[nn.Module, OffloadIndex] = weakref.WeakKeyDictionary()
_REGISTRY_LOCK = threading.Lock()


def register_offload_index(model: nn.Module, index: Mapping[str, WeightInfo]) -> None:
    """Remember offload index entries for ``model`` (merged with earlier ones).

    ``load_checkpoint_in_model`` records here where each disk-mapped weight of a safetensors
    checkpoint lives, so that ``dispatch_model`` can read it in place. The registry holds the
    model weakly.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or an entry is not a mapping.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model is a {type(model).__name__}: register_offload_index needs the nn.Module whose "
            "weights the index describes."
        )
    entries: OffloadIndex = {}
    for name, info in index.items():
        if not isinstance(info, Mapping):
            raise TypeError(_not_an_entry(name, info))
        entries[name] = dict(info)
    with _REGISTRY_LOCK:
        _REGISTRY.setdefault(model, {}).update(entries)


def registered_offload_index(model: nn.Module) -> OffloadIndex | None:
    """The offload index entries recorded for ``model`` (a copy), or ``None`` if there are none."""
    with _REGISTRY_LOCK:
        entries = _REGISTRY.get(model)
        if not entries:
            return None
        return {name: dict(info) for name, info in entries.items()}


def forget_offloaded(model: nn.Module, names: Sequence[str]) -> None:
    """Drop registry entries of ``model`` for tensors that now live on a device."""
    with _REGISTRY_LOCK:
        entries = _REGISTRY.get(model)
        if entries is None:
            return
        for name in names:
            entries.pop(name, None)
        if not entries:
            del _REGISTRY[model]
