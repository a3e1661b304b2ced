"""``HfDeepSpeedConfig``: Accelerate's reader of a DeepSpeed config, the one transformers asks.

transformers keeps a weak reference to such an object (``set_hf_deepspeed_config``) and asks
it ``is_zero3()`` (build models under ``deepspeed.zero.Init``) and for its ``config`` (the
dict it passes to ``zero.Init``). transformers' own class of that name needs the
``accelerate`` distribution installed; ``DeepSpeedPlugin.set_deepspeed_weakref`` registers
this one instead, so a transformers model is built partitioned under accel without it.
"""

from __future__ import annotations

import base64
import copy
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["HfDeepSpeedConfig"]


class HfDeepSpeedConfig:
    """A DeepSpeed config with dotted-key lookups (Accelerate 1.15's class and methods).

    Args:
        config_file_or_dict: A dict, a path to a JSON file, or base64-encoded JSON.

    Raises:
        ValueError: a string that is neither a file nor base64 JSON (naming the value).
    """

    def __init__(self, config_file_or_dict: dict[str, Any] | str | os.PathLike[str]) -> None:
        if isinstance(config_file_or_dict, dict):
            config = copy.deepcopy(config_file_or_dict)
        elif Path(config_file_or_dict).is_file():
            config = json.loads(Path(config_file_or_dict).read_text(encoding="utf-8"))
        else:
            try:
                decoded = base64.urlsafe_b64decode(str(config_file_or_dict)).decode("utf-8")
                config = json.loads(decoded)
            except (ValueError, UnicodeDecodeError) as error:
                raise ValueError(
                    f"HfDeepSpeedConfig({config_file_or_dict!r}): expected a dict, a path to a "
                    "JSON file or base64-encoded JSON"
                ) from error
        if not isinstance(config, dict):
            raise ValueError(
                f"HfDeepSpeedConfig: the config is {type(config).__name__}, not a dict"
            )
        self.config: dict[str, Any] = config
        stage = self.get_value("zero_optimization.stage", -1)
        self._stage = int(stage) if stage != "auto" else -1
        self._offload = any(
            self.get_value(f"zero_optimization.{part}.device") in ("cpu", "nvme")
            for part in ("offload_optimizer", "offload_param")
        )

    def find_config_node(self, ds_key_long: str) -> tuple[dict[str, Any] | None, str]:
        """The dict holding the last part of the dotted key, and that part."""
        node: Any = self.config
        *parents, key = ds_key_long.split(".")
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                return None, key
        return (node if isinstance(node, dict) else None), key

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        """The value at the dotted key (``default`` when absent)."""
        node, key = self.find_config_node(ds_key_long)
        return default if node is None else node.get(key, default)

    def del_config_sub_tree(self, ds_key_long: str, must_exist: bool = False) -> None:
        """Delete the dotted key.

        Raises:
            ValueError: ``must_exist`` and the key is absent.
        """
        node, key = self.find_config_node(ds_key_long)
        if node is None or key not in node:
            if must_exist:
                raise ValueError(f"Can't find {ds_key_long} entry in the config: {self.config}")
            return
        del node[key]

    def is_true(self, ds_key_long: str) -> bool:
        """Whether the key is present and true."""
        return bool(self.get_value(ds_key_long))

    def is_false(self, ds_key_long: str) -> bool:
        """Whether the key is present and false."""
        value = self.get_value(ds_key_long)
        return value is not None and not bool(value)

    def is_zero2(self) -> bool:
        """ZeRO stage 2."""
        return self._stage == 2

    def is_zero3(self) -> bool:
        """ZeRO stage 3."""
        return self._stage == 3

    def is_offload(self) -> bool:
        """Whether the optimizer or the parameters are offloaded (CPU or NVMe)."""
        return self._offload
