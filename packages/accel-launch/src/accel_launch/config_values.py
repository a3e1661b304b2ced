"""The values of a launch config's keys, checked one kind at a time.

Each function takes the key's name and the value the file gave, and returns the value as the
config holds it, or raises one ``ValueError`` naming the key, the value (cut short) and what to
write instead. :class:`accel_launch.config.ClusterConfig` calls them for every key it reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any

from accel_state.environment import str_to_bool

from .config_text import shown

__all__ = [
    "SECTION_EXAMPLES",
    "TEXT_EXAMPLES",
    "as_bool",
    "as_choice",
    "as_int",
    "as_lines",
    "as_section",
    "as_text",
    "is_scalar",
]

#: An example value of each text key, for the message that refuses a list or a mapping there.
TEXT_EXAMPLES = {
    "gpu_ids": "'0,1' or all",
    "main_process_ip": "10.0.0.1",
    "tpu_name": "my-tpu",
    "tpu_zone": "us-central1-a",
    "command_file": "commands.sh",
    "rdzv_backend": "static",
    "main_training_function": "main",
}
#: An example key of each section, for the message that refuses a key that is not a name.
SECTION_EXAMPLES = {
    "fsdp_config": "fsdp_version",
    "deepspeed_config": "zero_stage",
    "fp8_config": "backend",
    "dynamo_config": "dynamo_backend",
    "parallelism_config": "parallelism_config_tp_size",
    "mpirun_config": "mpirun_ccl",
}


def as_bool(name: str, value: Any) -> bool:
    """``true``/``false`` (a bool, 0 or 1, or a yes/no word)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        try:
            return bool(str_to_bool(value, to_bool=True))
        except ValueError:
            pass
    raise ValueError(f"{name}={shown(value)} is not a boolean: use true or false")


def as_int(name: str, value: Any) -> int:
    """A whole number (an int or its text; not a bool)."""
    if not isinstance(value, bool):
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
    raise ValueError(f"{name}={shown(value)} is not an integer: write a whole number such as 2")


def as_choice(kind: type[Enum], name: str, value: Any) -> Any:
    """``kind(value)``, or a ValueError naming the key, the value and the choices."""
    try:
        return kind(value)
    except (TypeError, ValueError):
        choices = ", ".join(str(member.value) for member in kind)
        raise ValueError(f"{name}={shown(value)} is not one of {choices}") from None


def is_scalar(value: Any) -> bool:
    """Whether ``value`` is one value (not a mapping or a list)."""
    return not isinstance(value, (Mapping, list, tuple, set))


def as_text(name: str, value: Any) -> str | None:
    """One text value (a number is read as its text); ``None`` stays ``None``."""
    if value is None or isinstance(value, str):
        return value
    if not is_scalar(value):
        raise ValueError(
            f"{name}={shown(value)} is not text: write one value, such as "
            f"`{name}: {TEXT_EXAMPLES[name]}`"
        )
    # YAML reads ``gpu_ids: 0`` as an int and ``main_process_ip: 10.0.0`` oddly.
    return str(value)


def as_section(name: str, value: Any) -> dict[str, Any]:
    """A section such as ``fsdp_config``: a mapping with names for keys (``None``: empty)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(
            f"{name} must be a mapping of settings, not {shown(value)}: write its keys "
            f"indented under `{name}:` (or `{name}: {{}}` for none)"
        )
    for key in value:
        if not isinstance(key, str):
            raise ValueError(
                f"{name} has the key {shown(key)}, which is not a name: its keys are setting "
                f"names such as {SECTION_EXAMPLES.get(name, 'a_setting')}; correct or remove "
                "that line"
            )
    return dict(value)


def as_lines(name: str, value: Any) -> list[str] | None:
    """A list of text lines (one text is one line); ``None`` stays ``None``."""
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(is_scalar(item) for item in value):
        return [str(item) for item in value]
    raise ValueError(
        f"{name}={shown(value)} is not a list of text lines: write one `- line` per item "
        f"under `{name}:`, or leave the key out"
    )
