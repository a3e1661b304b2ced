"""accel-bigmodel: run models larger than memory by spreading their layers over GPU, CPU and disk.

Meta-device initialisation, module sizes and device-map planning, streaming checkpoint loading,
the module-hook protocol, dispatch, and CPU/disk offload. Depends on accel-state, torch,
safetensors and psutil only: ``pip install accel-bigmodel`` is complete inference without the
training stack.
"""

from __future__ import annotations

from .__about__ import __version__

__all__ = ["__version__"]
