"""The former home of :mod:`accel_bigmodel.loading.files`, kept so that its imports still work.

New code imports from :mod:`accel_bigmodel.loading.files` (or ``load_state_dict`` from
:mod:`accel_bigmodel`).
"""

from __future__ import annotations

from .loading.files import SAFE_WEIGHTS_NAME, WEIGHTS_NAME, checkpoint_files, load_state_dict

__all__ = ["SAFE_WEIGHTS_NAME", "WEIGHTS_NAME", "load_state_dict"]

# dispatch.py still imports the old private name.
_checkpoint_files = checkpoint_files
