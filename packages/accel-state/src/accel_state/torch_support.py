"""The torch releases accel supports: the floor, and the features that arrived after it.

Every accel package declares ``torch>=`` :data:`TORCH_FLOOR`, and the ``floor`` session of the
suite runs every package's tests on exactly that release. A torch feature newer than the floor
is named here once, in :data:`TORCH_FEATURES`, with the release that brought it and how its
presence is detected: by what the installed torch offers (a parameter, a module, a function),
not by parsing version strings, so a backport or a nightly is judged by what it has.

Code uses a newer feature in one of two ways, never with a version check of its own:

* an optimisation or a pass-through option: ``if torch_has("dataloader_in_order"): ...``,
  falling back to what the floor offers;
* a whole feature that cannot work without it (FSDP2 needs ``fully_shard``): refused before any
  process group exists with :func:`require_torch`, whose error names the feature, the release
  that brought it, the installed one and the fix.

Every probe runs at most once per process.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Callable

import torch

__all__ = [
    "TORCH_FEATURES",
    "TORCH_FLOOR",
    "TorchFeature",
    "TorchTooOldError",
    "require_torch",
    "torch_has",
]

#: The oldest torch release every accel package declares and is tested on.
TORCH_FLOOR = "2.5"


@dataclasses.dataclass(frozen=True)
class TorchFeature:
    """A torch feature newer than :data:`TORCH_FLOOR` that accel uses when it is there.

    Attributes:
        key: The name code asks for (``torch_has(key)``).
        since: The first torch release that has it.
        title: What it is, for messages.
        probe: Returns whether the installed torch has it.
    """

    key: str
    since: str
    title: str
    probe: Callable[[], bool]


def _has_parameter(owner: str, name: str, parameter: str) -> Callable[[], bool]:
    def probe() -> bool:
        target = getattr(importlib.import_module(owner), name)
        return parameter in inspect.signature(target).parameters

    return probe


def _has_attribute(module: str, name: str) -> Callable[[], bool]:
    def probe() -> bool:
        if module.startswith("torch.distributed") and not torch.distributed.is_available():
            return False
        try:
            return hasattr(importlib.import_module(module), name)
        except ImportError:
            return False

    return probe


def _read_only_property(module: str, owner: str, name: str) -> Callable[[], bool]:
    def probe() -> bool:
        if module.startswith("torch.distributed") and not torch.distributed.is_available():
            return False
        try:
            found = getattr(importlib.import_module(module), owner).__dict__.get(name)
        except (ImportError, AttributeError):
            return False
        return isinstance(found, property) and found.fset is None

    return probe


#: Every torch feature accel uses that the floor lacks, by key.
TORCH_FEATURES: dict[str, TorchFeature] = {
    feature.key: feature
    for feature in (
        TorchFeature(
            "dataloader_in_order",
            "2.6",
            "DataLoader(in_order=...)",
            _has_parameter("torch.utils.data", "DataLoader", "in_order"),
        ),
        TorchFeature(
            "unsafe_globals_in_checkpoint",
            "2.6",
            "torch.serialization.get_unsafe_globals_in_checkpoint",
            _has_attribute("torch.serialization", "get_unsafe_globals_in_checkpoint"),
        ),
        TorchFeature(
            "fully_shard",
            "2.6",
            "FSDP2 (torch.distributed.fsdp.fully_shard)",
            _has_attribute("torch.distributed.fsdp", "fully_shard"),
        ),
        TorchFeature(
            "context_parallel",
            "2.6",
            "context parallelism (torch.distributed.tensor.experimental.context_parallel "
            "with a settable rotate method)",
            _has_attribute("torch.distributed.tensor.experimental._attention", "set_rotate_method"),
        ),
        TorchFeature(
            "fsdp2_grad_on_unsharded_param",
            "2.15",
            "FSDP2 accumulating unsharded gradients in the unsharded parameter's .grad "
            "(FSDPParam.unsharded_accumulated_grad a read-only view of it)",
            _read_only_property(
                "torch.distributed.fsdp._fully_shard._fsdp_param",
                "FSDPParam",
                "unsharded_accumulated_grad",
            ),
        ),
    )
}


class TorchTooOldError(RuntimeError):
    """A feature was asked for that the installed torch does not have.

    Attributes:
        feature: The missing :class:`TorchFeature`.
    """

    def __init__(self, feature: TorchFeature, what: str) -> None:
        self.feature = feature
        super().__init__(
            f"{what} needs {feature.title}, which torch has from {feature.since} on; this is "
            f"torch {torch.__version__}. Upgrade torch (pip install 'torch>={feature.since}') "
            f"or do without {what}"
        )


def _feature(key: str) -> TorchFeature:
    try:
        return TORCH_FEATURES[key]
    except KeyError:
        raise ValueError(
            f"torch_has(feature={key!r}): not a known torch feature; choose one of "
            f"{', '.join(sorted(TORCH_FEATURES))}"
        ) from None


@functools.cache
def torch_has(feature: str) -> bool:
    """Whether the installed torch has ``feature`` (a key of :data:`TORCH_FEATURES`).

    Raises:
        ValueError: ``feature`` is not a key of :data:`TORCH_FEATURES`.
    """
    return bool(_feature(feature).probe())


def require_torch(feature: str, what: str) -> None:
    """Refuse ``what`` (e.g. ``"the FSDP engine"``) unless torch has ``feature``.

    Raises:
        TorchTooOldError: the installed torch lacks it; the message names the release that
            brought it and the fix.
        ValueError: ``feature`` is not a key of :data:`TORCH_FEATURES`.
    """
    if not torch_has(feature):
        raise TorchTooOldError(_feature(feature), what)
