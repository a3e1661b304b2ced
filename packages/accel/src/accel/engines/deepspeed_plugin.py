"""``DeepSpeedPlugin``: Accelerate 1.15's DeepSpeed settings, resolved into one DeepSpeed config.

Fields default to ``None`` and are resolved in ``__post_init__`` from the ``ACCEL_DEEPSPEED_*``
variables (``accel launch --use_deepspeed --zero_stage ...`` writes them), as Accelerate reads
its ``ACCELERATE_DEEPSPEED_*`` ones. Without ``hf_ds_config`` the config is built from the
fields (ZeRO stage, offload devices, accumulation, clipping, the 16-bit gather on save); with
it (a JSON path or a dict) the config is that file, and a field that was given explicitly and
disagrees with a value the file sets is an error naming both (Accelerate lets the file win in
silence). ``"auto"`` values stay until ``prepare`` fills them from the loaders, the
Accelerator's accumulation and precision (see :mod:`accel.engines.deepspeed`), except
``stage3_gather_16bit_weights_on_model_save``, which is ``zero3_save_16bit_model`` (its
variable, else False), filled here as Accelerate does.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accel_state.accumulation_plan import accumulation_steps_from_environment
from accel_state.environment import (
    ACCEL_DEEPSPEED_CONFIG_FILE,
    ACCEL_DEEPSPEED_MOE_LAYER_CLS_NAMES,
    ACCEL_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE,
    ACCEL_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH,
    ACCEL_DEEPSPEED_OFFLOAD_PARAM_DEVICE,
    ACCEL_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH,
    ACCEL_DEEPSPEED_ZERO3_INIT,
    ACCEL_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL,
    ACCEL_DEEPSPEED_ZERO_STAGE,
    ACCEL_GRADIENT_CLIPPING,
    read_variable,
    str_to_bool,
)

if TYPE_CHECKING:
    import torch

__all__ = ["DeepSpeedPlugin"]

#: Plugin field -> dotted DeepSpeed config key.
FIELD_KEYS: dict[str, str] = {
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_param_device": "zero_optimization.offload_param.device",
    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
    "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}


def _run_precision() -> str:
    """The run's mixed precision ("no" before any ``AcceleratorState``)."""
    from accel_state import AcceleratorState

    state = AcceleratorState._shared_state
    return str(state.get("_mixed_precision", "no")) if state else "no"


def get_value(config: dict[str, Any], dotted: str) -> Any:
    """The value at ``a.b.c`` in a nested config (None when absent)."""
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def set_value(config: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``a.b.c`` in a nested config, creating the dicts on the way."""
    *parents, last = dotted.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def _env(name: str, default: str) -> str:
    return (read_variable(name) or "").strip() or default


def _env_save_16bit_model() -> bool:
    raw = _env(ACCEL_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL, "false")
    return bool(str_to_bool(raw, to_bool=True))


@dataclasses.dataclass
class DeepSpeedPlugin:
    """DeepSpeed ZeRO settings with Accelerate 1.15's fields (see the module docstring).

    Raises:
        ValueError: a bad field or variable, a config without ``zero_optimization``, an
            explicit field contradicting the config, or ``zero3_init_flag`` without ZeRO-3.
        NotImplementedError: MS-AMP (``enable_msamp``), which accel does not drive.
    """

    hf_ds_config: Any = None
    gradient_accumulation_steps: int | str | None = None
    gradient_clipping: float | str | None = None
    zero_stage: int | None = None
    is_train_batch_min: bool = True
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    offload_optimizer_nvme_path: str | None = None
    offload_param_nvme_path: str | None = None
    zero3_init_flag: bool | None = None
    zero3_save_16bit_model: bool | None = None
    transformer_moe_cls_names: str | None = None
    enable_msamp: bool | None = None
    msamp_opt_level: str | None = None
    _selected: bool = dataclasses.field(default=False, init=False, repr=False, compare=False)
    #: transformers' ``HfDeepSpeedConfig`` while it is in force (see ``set_deepspeed_weakref``).
    dschf: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.enable_msamp:
            raise NotImplementedError(
                "DeepSpeedPlugin(enable_msamp=True): MS-AMP is not driven by accel; train in "
                "bf16 (mixed_precision='bf16'), or FP8 through torchao with DDP (accel's "
                "FSDP2 engine computes an fp8 run in bf16)"
            )
        given = {name for name in FIELD_KEYS if getattr(self, name) is not None}
        if self.hf_ds_config is None:
            path = (read_variable(ACCEL_DEEPSPEED_CONFIG_FILE) or "").strip()
            self.hf_ds_config = path or None
        if self.hf_ds_config is not None:
            self.deepspeed_config = self._load(self.hf_ds_config)
            self._merge_fields(given)
        else:
            self._defaults_from_environment()
            self.deepspeed_config = self._built()
        self.zero_stage = int(get_value(self.deepspeed_config, "zero_optimization.stage") or 0)
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(
                f"DeepSpeedPlugin: zero_optimization.stage={self.zero_stage!r}: use 0, 1, 2 or 3"
            )
        self._resolve_zero3_init()
        if self.transformer_moe_cls_names is None:
            self.transformer_moe_cls_names = _env(ACCEL_DEEPSPEED_MOE_LAYER_CLS_NAMES, "") or None
        self.deepspeed_config.setdefault("steps_per_print", float("inf"))

    # --- resolution --------------------------------------------------------------------

    @staticmethod
    def _load(source: Any) -> dict[str, Any]:
        config: Any
        if isinstance(source, dict):
            config = copy.deepcopy(source)
        elif isinstance(source, str | os.PathLike):
            path = Path(source)
            if not path.is_file():
                raise ValueError(
                    f"DeepSpeedPlugin(hf_ds_config={os.fspath(source)!r}): no such file (a "
                    "DeepSpeed JSON config, or pass the config as a dict)"
                )
            try:
                config = json.loads(path.read_text())
            except ValueError as error:
                raise ValueError(f"{os.fspath(path)} is not valid JSON: {error}") from None
        else:
            config = getattr(source, "config", None)
            if not isinstance(config, dict):
                raise ValueError(
                    f"DeepSpeedPlugin(hf_ds_config={source!r}): pass a JSON path or a dict"
                )
            config = copy.deepcopy(config)
        if "zero_optimization" not in config:
            raise ValueError("Please specify the ZeRO optimization config in the DeepSpeed config.")
        config.setdefault("gradient_accumulation_steps", "auto")
        return config

    def _merge_fields(self, given: set[str]) -> None:
        """Explicit fields fill the config's ``auto`` or missing values and must not contradict."""
        for name, key in FIELD_KEYS.items():
            mine = getattr(self, name)
            theirs = get_value(self.deepspeed_config, key)
            if name in given:
                if theirs in (None, "auto"):
                    set_value(self.deepspeed_config, key, mine)
                elif theirs != mine:
                    raise ValueError(
                        f"DeepSpeedPlugin({name}={mine!r}) (`accel launch --{name}`) contradicts "
                        f"{key}={theirs!r} in the DeepSpeed config: set it in one place (or "
                        "make the config value 'auto')"
                    )
            elif theirs not in (None, "auto"):
                setattr(self, name, theirs)
        gather = FIELD_KEYS["zero3_save_16bit_model"]
        if get_value(self.deepspeed_config, gather) == "auto":
            # Accelerate's shipped ZeRO-3 configs say "auto": the plugin's setting (its
            # variable, else False), as Accelerate fills it.
            self.zero3_save_16bit_model = _env_save_16bit_model()
            set_value(self.deepspeed_config, gather, self.zero3_save_16bit_model)

    def _defaults_from_environment(self) -> None:
        if self.gradient_accumulation_steps is None:
            # The Accelerator's grammar and message (accel-state's one parser); unset is
            # "auto", which prepare fills from the Accelerator's plan.
            found = accumulation_steps_from_environment()
            self.gradient_accumulation_steps = "auto" if found is None else found[1]
        if self.gradient_clipping is None:
            raw = _env(ACCEL_GRADIENT_CLIPPING, "auto")
            self.gradient_clipping = raw if raw == "auto" else float(raw)
        if self.zero_stage is None:
            self.zero_stage = int(_env(ACCEL_DEEPSPEED_ZERO_STAGE, "2"))
        if self.offload_optimizer_device is None:
            self.offload_optimizer_device = _env(ACCEL_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE, "none")
        if self.offload_param_device is None:
            self.offload_param_device = _env(ACCEL_DEEPSPEED_OFFLOAD_PARAM_DEVICE, "none")
        if self.offload_optimizer_nvme_path is None:
            self.offload_optimizer_nvme_path = _env(
                ACCEL_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH, "none"
            )
        if self.offload_param_nvme_path is None:
            self.offload_param_nvme_path = _env(ACCEL_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH, "none")
        if self.zero3_save_16bit_model is None:
            self.zero3_save_16bit_model = _env_save_16bit_model()

    def _built(self) -> dict[str, Any]:
        def offload(device: str | None, path: str | None) -> dict[str, Any]:
            entry: dict[str, Any] = {"device": device}
            if device == "nvme":
                entry["nvme_path"] = path
            return entry

        config: dict[str, Any] = {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "zero_optimization": {
                "stage": self.zero_stage,
                "offload_optimizer": offload(
                    self.offload_optimizer_device, self.offload_optimizer_nvme_path
                ),
                "offload_param": offload(self.offload_param_device, self.offload_param_nvme_path),
                "stage3_gather_16bit_weights_on_model_save": self.zero3_save_16bit_model,
            },
        }
        if self.gradient_clipping not in (None, "auto"):
            config["gradient_clipping"] = self.gradient_clipping
        else:
            config["gradient_clipping"] = "auto"
        return config

    def _resolve_zero3_init(self) -> None:
        explicit = self.zero3_init_flag is not None
        if self.zero3_init_flag is None:
            raw = _env(ACCEL_DEEPSPEED_ZERO3_INIT, str(self.zero_stage == 3))
            self.zero3_init_flag = bool(str_to_bool(raw, to_bool=True))
        if self.zero3_init_flag and self.zero_stage != 3:
            if explicit:
                raise ValueError(
                    f"DeepSpeedPlugin(zero3_init_flag=True) with ZeRO stage {self.zero_stage}: "
                    "building the model partitioned (zero.Init) is ZeRO-3 only; set "
                    "zero_stage=3 or drop zero3_init_flag"
                )
            self.zero3_init_flag = False

    # --- Accelerate's helpers ------------------------------------------------------------

    def is_zero3(self) -> bool:
        """Whether the config is ZeRO stage 3."""
        return self.zero_stage == 3

    def get_value(self, key: str, default: Any = None) -> Any:
        """The config value at the dotted ``key`` (``default`` when absent)."""
        value = get_value(self.deepspeed_config, key)
        return default if value is None else value

    def set_moe_leaf_modules(self, model: torch.nn.Module) -> None:
        """Mark ``model``'s MoE blocks as ZeRO-3 leaf modules (``deepspeed.utils``'s mark).

        The classes are ``transformer_moe_cls_names`` (comma-separated names; default
        ``ACCEL_DEEPSPEED_MOE_LAYER_CLS_NAMES``, which ``accel launch`` writes). ZeRO-3 then
        gathers each such block whole instead of hooking its experts one by one (only some
        experts run per token). Nothing happens without names. ``prepare`` calls it.

        Raises:
            ValueError: a name is not the class of a module of ``model`` (nothing is marked).
            ImportError: DeepSpeed is not installed.
        """
        names = self.transformer_moe_cls_names
        if not names:
            return
        wanted = [part.strip() for part in str(names).split(",") if part.strip()]
        present = {type(module).__name__: type(module) for module in model.modules()}
        missing = [name for name in wanted if name not in present]
        if missing:
            raise ValueError(
                f"Could not find a transformer layer class called {missing[0]!r} to wrap in the "
                f"model. DeepSpeedPlugin(transformer_moe_cls_names={names!r}) (or "
                f"{ACCEL_DEEPSPEED_MOE_LAYER_CLS_NAMES}) must name classes of the model's "
                f"modules: {', '.join(sorted(present))}"
            )
        from .deepspeed import import_deepspeed

        import_deepspeed()
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, [present[name] for name in wanted])

    @property
    def hf_config(self) -> dict[str, Any]:
        """The DeepSpeed config (Accelerate's ``hf_ds_config.config``)."""
        return self.deepspeed_config

    # --- selection among several plugins ---------------------------------------------------

    @property
    def selected(self) -> bool:
        """Whether this is the active plugin (the one the next ``prepare`` uses)."""
        return self._selected

    @selected.setter
    def selected(self, value: bool) -> None:
        raise NotImplementedError(
            "DeepSpeedPlugin.selected is set by AcceleratorState().select_deepspeed_plugin(name)"
        )

    def select(self, _from_accelerator_state: bool = False) -> None:
        """Make this the active plugin (only through ``select_deepspeed_plugin``).

        Raises:
            ValueError: called directly, where the state would not know of the change.
        """
        if not _from_accelerator_state:
            raise ValueError(
                "A DeepSpeedPlugin is selected with "
                "AcceleratorState().select_deepspeed_plugin(name), so that every other plugin "
                "is unselected at the same time"
            )
        self._selected = True
        self.set_deepspeed_weakref()

    def _unselect(self) -> None:
        self._selected = False

    # --- building models partitioned (ZeRO-3) ---------------------------------------------

    def model_init_config(self) -> dict[str, Any]:
        """The config ``deepspeed.zero.Init`` builds models with, before ``prepare`` runs.

        The batch-size "auto" values are not known yet and do not matter to partitioning
        (1 stands in); the precision is the run's (``AcceleratorState().mixed_precision``), so
        parameters are created in the dtype the engine will train them in.
        """
        config = copy.deepcopy(self.deepspeed_config)
        for key in ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu"):
            if config.get(key, "auto") == "auto":
                config[key] = 1
        if config.get("train_batch_size") == "auto":
            del config["train_batch_size"]
        if config.get("gradient_clipping") == "auto":
            config["gradient_clipping"] = 0.0
        precision = _run_precision()
        for key in ("bf16", "fp16"):
            section = config.get(key)
            enabled = section.get("enabled", "auto") if isinstance(section, dict) else "auto"
            if enabled == "auto":
                config[key] = {**(section or {}), "enabled": precision == key}
        return config

    def set_deepspeed_weakref(self) -> None:
        """Tell transformers to build its models under ``zero.Init`` (ZeRO-3 init only).

        With ``zero3_init_flag`` and transformers installed, an ``HfDeepSpeedConfig`` (accel's:
        transformers' own needs the accelerate distribution) is kept alive in ``dschf`` and
        registered with transformers, so ``from_pretrained`` / ``from_config`` partition the
        weights as they are created; otherwise transformers' setting is cleared. Without
        transformers nothing happens (:func:`accel.utils.deepspeed.zero3_init_context` builds
        other models partitioned), where Accelerate raises.
        """
        import importlib.util

        self.dschf = None
        if importlib.util.find_spec("transformers") is None:
            return
        from transformers.integrations import deepspeed as hf_deepspeed

        from .hf_deepspeed_config import HfDeepSpeedConfig

        hf_deepspeed.unset_hf_deepspeed_config()
        if self.zero3_init_flag:
            self.dschf = HfDeepSpeedConfig(self.model_init_config())
            hf_deepspeed.set_hf_deepspeed_config(self.dschf)

    @contextlib.contextmanager
    def zero3_init_context_manager(self, enable: bool = False) -> Iterator[None]:
        """Within it, ``zero3_init_flag`` is ``enable`` (transformers follows; Accelerate's).

        Raises:
            ValueError: ``enable=True`` below ZeRO-3.
        """
        if enable and self.zero_stage != 3:
            raise ValueError(
                f"zero3_init_context_manager(enable=True) with ZeRO stage {self.zero_stage}: "
                "building partitioned models is ZeRO-3 only"
            )
        old = self.zero3_init_flag
        if old == enable:
            yield
            return
        self.zero3_init_flag = enable
        self.set_deepspeed_weakref()
        try:
            yield
        finally:
            self.zero3_init_flag = old
            self.set_deepspeed_weakref()
