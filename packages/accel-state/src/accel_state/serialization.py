"""Saving and loading objects safely from several processes.

``save`` writes on the main process only (or once per node), atomically: the file appears
under its name only when complete. ``safe_serialization=True`` writes safetensors. ``load``
uses ``torch.load(weights_only=True)`` and allows, besides torch's own safe types, only numpy
arrays, scalars and dtypes. ``serialize_loadable`` refuses, before anything is written, an
object that ``load`` would refuse.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any

import torch

from .files import atomic_path
from .imports import is_numpy_available
from .state import PartialState
from .torch_support import torch_has

__all__ = ["clean_state_dict_for_safetensors", "load", "save", "serialize_loadable"]


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    return (str(tensor.device), tensor.untyped_storage().data_ptr())


def clean_state_dict_for_safetensors(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Make a state dict writable by safetensors.

    Tensors that are exact aliases of an earlier entry (same storage, offset, shape and
    strides, as tied weights are) are dropped with a logged warning naming them; tensors that share
    storage without being aliases are copied, so no data is lost; every tensor is made
    contiguous.
    """
    seen: dict[tuple[str, int], list[tuple[str, torch.Tensor]]] = {}
    cleaned: dict[str, Any] = {}
    removed: list[str] = []
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor) or value.device.type == "meta":
            cleaned[name] = value
            continue
        if value.untyped_storage().nbytes() == 0:
            # Empty storages all have data pointer 0: they share nothing, keep each one.
            cleaned[name] = value.contiguous()
            continue
        key = _storage_key(value)
        alias_of = None
        for other_name, other in seen.get(key, []):
            if (
                other.storage_offset() == value.storage_offset()
                and other.shape == value.shape
                and other.stride() == value.stride()
            ):
                alias_of = other_name
                break
        if alias_of is not None:
            removed.append(name)
            continue
        shares = key in seen and value.untyped_storage().nbytes() > 0
        seen.setdefault(key, []).append((name, value))
        cleaned[name] = value.clone().contiguous() if shares else value.contiguous()
    if removed:
        logging.getLogger(__name__).warning(
            "Removed shared tensor %s while saving: they alias other entries (tied weights). "
            "Re-tie them after loading.",
            sorted(removed),
        )
    return cleaned


def save(
    obj: Any,
    f: str | os.PathLike[str],
    save_on_each_node: bool = False,
    safe_serialization: bool = False,
) -> None:
    """Save ``obj`` to ``f`` from the main process (or each node's main process).

    The file is written to a temporary sibling, fsynced and renamed (see
    :func:`accel_state.files.atomic_path`), so a crash never leaves a partial file under ``f``.

    Args:
        obj: The object; a mapping of names to tensors when ``safe_serialization``.
        f: Destination path.
        save_on_each_node: Save on the local main process of every node (for nodes that
            do not share a file system).
        safe_serialization: Write safetensors (``pip install "accel-state[safetensors]"``)
            instead of a pickle.

    Raises:
        TypeError: ``safe_serialization`` is set and ``obj`` is not a mapping of tensors.
        ImportError: safetensors is not installed.
    """
    state = PartialState()
    if not (state.is_main_process or (save_on_each_node and state.is_local_main_process)):
        return
    path = os.fspath(f)
    if safe_serialization:
        if not isinstance(obj, Mapping):
            raise TypeError(
                f"save(safe_serialization=True) needs a mapping of names to tensors, got "
                f"{type(obj).__name__!r}: pass a state dict or use safe_serialization=False"
            )
        bad = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise TypeError(
                f"save(safe_serialization=True): entries {bad[:5]} are not tensors; safetensors "
                "stores tensors only, use safe_serialization=False for other objects"
            )
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise ImportError(
                "save(safe_serialization=True) needs safetensors: "
                'pip install "accel-state[safetensors]"'
            ) from None
        cleaned = clean_state_dict_for_safetensors(obj)
    with atomic_path(path) as temporary:
        if safe_serialization:
            save_file(cleaned, temporary, metadata={"format": "pt"})
        else:
            torch.save(obj, temporary)


def _numpy_safe_globals() -> list[Any]:
    if not is_numpy_available():
        return []
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    # Arrays, dtypes and scalars (``scalar`` rebuilds one from its dtype and raw bytes; an
    # object scalar or array holds values the restricted unpickler has already vetted).
    allowed: list[Any] = [
        core.multiarray._reconstruct,
        core.multiarray.scalar,
        np.ndarray,
        np.dtype,
    ]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        allowed += [getattr(dtypes, n) for n in dir(dtypes) if n.endswith("DType")]
    return allowed


def _unsafe_globals(buffer: Any) -> list[str]:
    """The globals in a ``torch.save`` stream that a ``weights_only`` load would refuse.

    torch >= 2.6 lists them all without unpickling; on older torch the stream is loaded with
    ``weights_only=True`` and the first global torch refuses is named.
    """
    import pickle

    with torch.serialization.safe_globals(_numpy_safe_globals()):
        if torch_has("unsafe_globals_in_checkpoint"):
            return list(torch.serialization.get_unsafe_globals_in_checkpoint(buffer))
        try:
            torch.load(buffer, weights_only=True)
        except pickle.UnpicklingError as error:
            refused = re.search(r"GLOBAL ([\w.]+)", str(error))
            return [refused.group(1) if refused else str(error).splitlines()[0]]
    return []


def serialize_loadable(obj: Any, what: str) -> bytes:
    """``torch.save`` ``obj`` into bytes that :func:`load` reads back safely, or refuse it.

    :func:`load` unpickles with ``weights_only=True``: tensors, numbers, strings, plain
    containers and numpy arrays, scalars and dtypes. Anything else would be saved fine and
    then refused at load time, so it is refused here, before any file is written.

    Raises:
        ValueError: ``obj`` holds other objects; ``what`` names it in the message.
    """
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    unsafe = _unsafe_globals(buffer)
    buffer.seek(0)
    if unsafe:
        raise ValueError(
            f"{what} holds {', '.join(sorted(unsafe))}, which cannot be loaded back safely "
            "(checkpoints are read with weights_only=True: tensors, numbers, strings, lists, "
            "tuples, dicts and numpy values only). Return only such values from state_dict(), "
            "e.g. convert other objects to tensors, numbers or strings"
        )
    return buffer.getvalue()


def load(f: Any, map_location: Any = None, **kwargs: Any) -> Any:
    """Load an object saved with :func:`save` (or ``torch.save``) without running pickled code.

    ``weights_only=True`` is the default; numpy arrays and dtypes (found in RNG states) are
    allowed. Pass ``weights_only=False`` only for files you trust.
    """
    kwargs.setdefault("weights_only", True)
    if kwargs["weights_only"]:
        with torch.serialization.safe_globals(_numpy_safe_globals()):
            return torch.load(f, map_location=map_location, **kwargs)
    return torch.load(f, map_location=map_location, **kwargs)
