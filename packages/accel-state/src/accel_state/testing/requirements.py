"""Why a test cannot run here: reasons to skip, computed without importing pytest.

``require_reasons(min_cuda_gpus=2)`` returns a list of human-readable reasons (empty when the
test can run); test suites turn it into ``pytest.mark.skipif(bool(reasons), reason=...)``.
"""

from __future__ import annotations

from accel_state.devices import device_count
from accel_state.imports import is_cuda_available, is_package_available, is_torch_version
from accel_state.torch_support import TORCH_FEATURES, torch_has

__all__ = ["require_reasons"]


def require_reasons(
    min_cuda_gpus: int = 0,
    min_torch: str | None = None,
    modules: tuple[str, ...] = (),
    torch_features: tuple[str, ...] = (),
) -> list[str]:
    """Return the reasons a test with these requirements must be skipped on this machine.

    Args:
        min_cuda_gpus: CUDA devices the test needs.
        min_torch: Oldest torch version the test supports.
        modules: Modules that must be importable.
        torch_features: Keys of ``accel_state.torch_support.TORCH_FEATURES`` the test needs
            (``("fully_shard",)`` for FSDP2).
    """
    reasons = []
    if min_cuda_gpus:
        available = device_count("cuda") if is_cuda_available() else 0
        if available < min_cuda_gpus:
            reasons.append(f"needs {min_cuda_gpus} CUDA device(s), found {available}")
    if min_torch is not None and not is_torch_version(">=", min_torch):
        reasons.append(f"needs torch>={min_torch}")
    for module in modules:
        if not is_package_available(module):
            reasons.append(f"needs the module {module!r}")
    for key in torch_features:
        if not torch_has(key):
            feature = TORCH_FEATURES[key]
            reasons.append(f"needs {feature.title}: torch>={feature.since}")
    return reasons
