"""Conversions of logged values shared by the trackers: JSON forms, scalars, flat configs."""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Mapping
from typing import Any, cast

import torch

from .base import warn

_NON_FINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}


def finite_or_text(value: float) -> float | str:
    """JSON has no NaN or infinity: write them as the strings ``NaN``, ``Infinity``..."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return _NON_FINITE[value]
    return float(value)


def is_numpy(value: Any) -> bool:
    """Whether ``value`` is a numpy array or scalar (checked without importing numpy)."""
    return type(value).__module__.partition(".")[0] == "numpy" and hasattr(value, "tolist")


def jsonable(value: Any, path: str) -> Any:
    """Convert ``value`` into plain JSON data (tensors and numpy values included).

    Raises:
        TypeError: something in ``value`` has no JSON form; the message names ``path``.
    """
    if value is None or isinstance(value, (bool, str)):
        # str.__str__ drops str subclasses (enums) to their plain text.
        return value if not isinstance(value, str) else str.__str__(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return finite_or_text(value)
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu()
        return jsonable(data.item() if data.ndim == 0 else data.tolist(), path)
    if is_numpy(value):
        return jsonable(value.item() if getattr(value, "ndim", 0) == 0 else value.tolist(), path)
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"cannot log {path}: its key {key!r} is a {type(key).__name__}, and JSON "
                    "object keys must be strings"
                )
            out[key] = jsonable(item, f"{path}[{key!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [jsonable(item, f"{path}[{index}]") for index, item in enumerate(value)]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(
        f"cannot log {path}: a value of type {type(value).__qualname__} has no JSON form; log "
        "numbers, strings, booleans, None, tensors, numpy values, or lists/dicts of them "
        "(convert it, e.g. with str(), first)"
    )


def jsonable_mapping(values: Any, what: str) -> dict[str, Any]:
    """Convert a mapping of named values; every key must be a string."""
    if not isinstance(values, Mapping):
        raise TypeError(f"{what} must be a dict of name -> value, got {type(values).__name__}")
    out: dict[str, Any] = {}
    for key, item in values.items():
        if not isinstance(key, str):
            raise TypeError(
                f"{what} has the key {key!r} of type {type(key).__name__}: names must be strings"
            )
        out[key] = jsonable(item, repr(key))
    return out


def check_step(step: Any) -> int | None:
    """Accept ``None`` or an integer (Python, numpy or 0-d tensor) as the step."""
    if step is None:
        return None
    if isinstance(step, torch.Tensor) and step.ndim == 0 and not step.is_floating_point():
        return int(step.item())
    if is_numpy(step) and getattr(step, "ndim", 1) == 0 and hasattr(step, "__index__"):
        return int(step)
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    raise TypeError(f"step must be an int or None, got {step!r} ({type(step).__name__})")


def check_no_kwargs(tracker: str, method: str, kwargs: Mapping[str, Any]) -> None:
    """Refuse keyword arguments a tracker method does not take (``TypeError``)."""
    if kwargs:
        raise TypeError(
            f"{tracker}.{method} got unexpected keyword arguments {sorted(kwargs)}: it takes none "
            "(they usually come from init_kwargs / log_kwargs keyed by the tracker's name)"
        )


# --- JSON lines -----------------------------------------------------------------------------


def scalar(value: Any) -> int | float | None:
    """The Python number behind ``value``, or ``None`` if it is not a single real number."""
    if isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return cast(float, value.detach().cpu().item())
    if is_numpy(value) and getattr(value, "size", 0) == 1:
        item = value.item()
        return item if isinstance(item, (bool, int, float)) else None
    return None


def flatten_config(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten a configuration into what TensorBoard's hparams plugin accepts.

    Nested dicts become ``a/b`` names (``{"opt": {"lr": 1}}`` -> ``{"opt/lr": 1}``); numbers,
    strings and booleans are kept, anything else goes through ``str()``.
    """
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_config(value, f"{name}/"))
        elif isinstance(value, (bool, str)):
            flat[name] = value
        elif (number := scalar(value)) is not None:
            flat[name] = number
        else:
            flat[name] = str(value)
    return flat


def check_values(values: Any, what: str = "values") -> dict[str, Any]:
    """``values`` as a plain dict with string keys (``TypeError`` naming the bad key)."""
    if not isinstance(values, Mapping):
        raise TypeError(f"{what} must be a dict of name -> value, got {type(values).__name__}")
    for key in values:
        if not isinstance(key, str):
            raise TypeError(
                f"{what} has the key {key!r} of type {type(key).__name__}: names must be strings"
            )
    return dict(values)


def numbers_only(
    values: Mapping[str, Any],
    tracker: str,
    warned: set[str],
    fix: str,
    strings: bool = False,
) -> dict[str, int | float | str]:
    """The entries of ``values`` that are single real numbers (tensors and numpy included).

    A backend that stores only numbers (and strings, with ``strings=True``) cannot take the
    others: each such key is named in a warning the first time it is left out (``warned``
    remembers which were), with ``fix``.
    """
    kept: dict[str, int | float | str] = {}
    what = "numbers and strings" if strings else "numbers"
    for key, value in values.items():
        number = scalar(value)
        if number is not None:
            kept[key] = number
        elif strings and isinstance(value, str):
            kept[key] = str.__str__(value)
        elif key not in warned:
            warned.add(key)
            warn(
                f"{tracker} stores only {what}: {key!r} ({type(value).__name__}) is left out of "
                f"this and later logs; {fix}"
            )
    return kept


def image_array(image: Any) -> Any:
    """An image as the libraries take it: numpy and PIL pass through, a tensor becomes numpy.

    A 3-d tensor in channels-first layout (``C, H, W`` with 1, 3 or 4 channels) is turned
    into ``H, W, C``; floats stay floats (the libraries read them as 0..1).
    """
    if isinstance(image, torch.Tensor):
        data = image.detach().cpu()
        if data.ndim == 3 and data.shape[0] in (1, 3, 4) and data.shape[-1] not in (1, 3, 4):
            data = data.permute(1, 2, 0)
        return data.numpy()
    return image


def pil_image(image: Any, key: str, install: str) -> Any:
    """``image`` as a ``PIL.Image.Image``, for libraries that only convert PIL images reliably.

    PIL images pass through. Arrays and tensors (``H, W``, ``H, W, C`` or channels-first
    ``C, H, W`` with 1, 3 or 4 channels) are converted: ``uint8`` as is, booleans to 0/255,
    floats read as 0..1 (clipped) and scaled to 0..255, other integers if within 0..255.

    Args:
        image: The image.
        key: The name it is logged under (for the messages).
        install: The pip command that installs Pillow with the tracker's extra.

    Raises:
        ImportError: Pillow is not installed (the message gives ``install``).
        ValueError: the array's shape or values are not an image's.
    """
    try:
        Image = importlib.import_module("PIL.Image")
    except ImportError as error:
        raise ImportError(f"logging the image {key!r} needs Pillow: {install}") from error
    if isinstance(image, Image.Image):
        return image
    import numpy as np

    array = np.asarray(image_array(image))
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[-1] not in (3, 4)):
        raise ValueError(
            f"cannot log {key!r} as an image: shape {tuple(array.shape)} is not (H, W), "
            "(H, W, 1|3|4) or (1|3|4, H, W)"
        )
    if array.dtype == np.bool_:
        array = array.astype(np.uint8) * 255
    elif np.issubdtype(array.dtype, np.floating):
        if not np.isfinite(array).all():
            raise ValueError(f"cannot log {key!r} as an image: it holds NaN or infinite values")
        array = np.rint(np.clip(array, 0.0, 1.0) * 255.0).astype(np.uint8)
    elif np.issubdtype(array.dtype, np.integer) and array.dtype != np.uint8:
        if array.size and (array.min() < 0 or array.max() > 255):
            raise ValueError(
                f"cannot log {key!r} as an image: its integers lie outside 0..255 (pass uint8 "
                "values, or floats in 0..1)"
            )
        array = array.astype(np.uint8)
    elif array.dtype != np.uint8:
        raise ValueError(f"cannot log {key!r} as an image: its dtype {array.dtype} is not numeric")
    return Image.fromarray(np.ascontiguousarray(array))


def image_list(value: Any) -> list[Any]:
    """The images logged under one name: a list or tuple as given, anything else as one."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def require_rows(table_name: str, data: Any, dataframe: Any) -> None:
    """Refuse a ``log_table`` call that gives neither ``data`` rows nor a ``dataframe``.

    Raises:
        ValueError: both are ``None``; the message names the table and the fix.
    """
    if data is None and dataframe is None:
        raise ValueError(
            f"log_table({table_name!r}) needs rows: pass data=[[...], ...] (with columns=...) "
            "or dataframe=..."
        )
