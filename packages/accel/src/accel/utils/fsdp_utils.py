"""Accelerate's ``accelerate.utils.fsdp_utils``, re-exported from the packages that own it.

``merge_fsdp_weights``, ``fsdp2_canonicalize_names`` and ``get_fsdp2_grad_scaler`` are real
(the FSDP2 engine's own), and so are ``enable_fsdp_ram_efficient_loading`` /
``disable_fsdp_ram_efficient_loading`` (the plugin's: they set the variables transformers and
the plugin read), ``save_fsdp_model`` / ``load_fsdp_model`` / ``save_fsdp_optimizer`` /
``load_fsdp_optimizer`` (one object at a time in ``save_state``'s layout: transformers'
``Trainer`` checkpoints FSDP with them) and ``get_parameters_from_modules``. The others are
Accelerate's internal steps of preparing an FSDP model, which accel's FSDP2 engine performs
inside ``Accelerator.prepare``; they import, and refuse when called, saying so.
"""

from __future__ import annotations

from accel.engines.fsdp2 import fsdp2_canonicalize_names, get_fsdp2_grad_scaler
from accel.engines.fsdp2_functions import (
    get_parameters_from_modules,
    load_fsdp_model,
    load_fsdp_optimizer,
    save_fsdp_model,
    save_fsdp_optimizer,
)
from accel.engines.fsdp2_merge import merge_fsdp_weights
from accel.engines.fsdp_plugin import (
    disable_fsdp_ram_efficient_loading,
    enable_fsdp_ram_efficient_loading,
)
from accel.unavailable import FSDP_UTILS

ensure_weights_retied = FSDP_UTILS["ensure_weights_retied"]
fsdp2_apply_ac = FSDP_UTILS["fsdp2_apply_ac"]
fsdp2_load_full_state_dict = FSDP_UTILS["fsdp2_load_full_state_dict"]
fsdp2_prepare_auto_wrap_policy = FSDP_UTILS["fsdp2_prepare_auto_wrap_policy"]
fsdp2_prepare_model = FSDP_UTILS["fsdp2_prepare_model"]
fsdp2_switch_optimizer_parameters = FSDP_UTILS["fsdp2_switch_optimizer_parameters"]

__all__ = [
    "disable_fsdp_ram_efficient_loading",
    "enable_fsdp_ram_efficient_loading",
    "ensure_weights_retied",
    "fsdp2_apply_ac",
    "fsdp2_canonicalize_names",
    "fsdp2_load_full_state_dict",
    "fsdp2_prepare_auto_wrap_policy",
    "fsdp2_prepare_model",
    "fsdp2_switch_optimizer_parameters",
    "get_fsdp2_grad_scaler",
    "get_parameters_from_modules",
    "load_fsdp_model",
    "load_fsdp_optimizer",
    "merge_fsdp_weights",
    "save_fsdp_model",
    "save_fsdp_optimizer",
]
