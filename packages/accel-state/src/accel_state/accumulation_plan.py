"""The accumulation plan: gradient accumulation's settings, parsed once at the door.

A step count reaches accel from four places: the ``Accelerator``'s
``gradient_accumulation_steps`` argument, a ``GradientAccumulationPlugin``'s ``num_steps``,
the ``ACCEL_GRADIENT_ACCUMULATION_STEPS`` variable (or Accelerate's
``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``) that ``accel launch`` writes, and the DeepSpeed
plugin, which reads the same variable. Each goes through :func:`parse_accumulation_steps`, the
one grammar and the one error message, and the result is a frozen :class:`AccumulationPlan`
that ``GradientState`` stores and reads without converting anything again.

This module lives in accel-state, the lowest package that both accel-amp (the plugin, the
accumulator) and accel (the DeepSpeed plugin) import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from .environment import ACCEL_GRADIENT_ACCUMULATION_STEPS, lookup_variable

__all__ = [
    "AccumulationPlan",
    "PlansAccumulation",
    "accumulation_steps_from_environment",
    "parse_accumulation_steps",
]

#: What every refused step count is told (the fix).
_EXPECTED = "must be an integer >= 1 (1 means no accumulation)"


def _refuse(value: object, name: str, owner: str | None) -> ValueError:
    shown = f"{name}={value!r}"
    return ValueError(f"{owner}({shown}): {_EXPECTED}" if owner else f"{shown}: {_EXPECTED}")


def parse_accumulation_steps(
    value: object, name: str, *, owner: str | None = None, text: bool = False
) -> int:
    """Read a step count with the one grammar: a whole number >= 1.

    A number is an ``int`` or a ``float`` holding a whole number (``2.0`` is 2); ``True`` and
    ``False`` are not numbers here. Text is what an environment variable holds: it is accepted
    only with ``text=True`` and read as a decimal integer (surrounding spaces ignored), so a
    Python argument or field given as a string is refused rather than guessed at.

    Args:
        value: The raw value.
        name: The argument, field or variable it came from; the error names it.
        owner: The class whose field it is (the error then reads ``owner(name=value)``).
        text: Whether ``value`` is an environment variable's text.

    Returns:
        The step count.

    Raises:
        ValueError: ``value`` is not a whole number >= 1; the message names ``name`` (and
            ``owner``), the value and the fix.
    """
    number: object = value
    if text and isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            raise _refuse(value, name, owner) from None
    if isinstance(number, bool) or not isinstance(number, int | float):
        raise _refuse(value, name, owner)
    if isinstance(number, float) and not number.is_integer():
        raise _refuse(value, name, owner)
    if number < 1:
        raise _refuse(value, name, owner)
    return int(number)


def accumulation_steps_from_environment(
    environ: Mapping[str, str] | None = None,
) -> tuple[str, int] | None:
    """The step count the launcher set: ``(variable, steps)``, or None when it is unset.

    Reads ``ACCEL_GRADIENT_ACCUMULATION_STEPS`` or Accelerate's
    ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS`` (unset or empty counts as unset) with
    :func:`parse_accumulation_steps`; the Accelerator and the DeepSpeed plugin both read the
    variable here, so both accept and refuse the same values with the same message.

    Raises:
        ValueError: the value is not a whole number >= 1 (the message names the variable that
            holds it), or both spellings are set and disagree.
    """
    found = lookup_variable(ACCEL_GRADIENT_ACCUMULATION_STEPS, environ)
    if found is None:
        return None
    variable, raw = found
    return variable, parse_accumulation_steps(raw, variable, text=True)


@dataclasses.dataclass(frozen=True)
class AccumulationPlan:
    """How gradients accumulate, decided once: what ``GradientState`` stores and reads.

    Build one with :func:`parse_accumulation_steps` (or accel-amp's
    ``GradientAccumulationPlugin.to_plan()``); the fields mean what the plugin's mean.

    Args:
        steps: Micro-batches per optimizer step (1: no accumulation).
        adjust_scheduler: A prepared scheduler counts optimizer steps (``True``) or every
            micro-batch (``False``).
        sync_with_dataloader: Also complete a window on the last batch of each data loader.
        sync_each_batch: All-reduce gradients on every micro-batch instead of entering
            ``no_sync``.
        source: The environment variable ``steps`` came from (None: an argument or a
            plugin); a DeepSpeed plugin built from the environment takes ``steps`` from
            here instead of reading the variable again. Not part of equality.

    Raises:
        ValueError: ``steps`` is not an ``int`` >= 1 (a plan holds parsed values only).
    """

    steps: int = 1
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False
    source: str | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        # Not a second parse: a plan is built from parsed values, and this only keeps a plan
        # built by hand from holding text or a float that every read would then trip over.
        steps = self.steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise _refuse(steps, "steps", "AccumulationPlan")

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any], owner: str | None = None) -> AccumulationPlan:
        """The plan of a plugin's non-default fields (Accelerate's ``plugin_kwargs``).

        For objects that are not accel-amp's plugin (Accelerate's, or one assigned to
        ``GradientState.plugin_kwargs``): ``num_steps`` goes through
        :func:`parse_accumulation_steps`; other keys are ignored, as ``GradientState`` always
        has.

        Args:
            kwargs: ``num_steps``, ``adjust_scheduler``, ``sync_with_dataloader``,
                ``sync_each_batch``; a missing key keeps its default.
            owner: The plugin's class name, for the error message.

        Raises:
            ValueError: ``num_steps`` is not a whole number >= 1.
        """
        raw = kwargs.get("num_steps")
        if raw is None:
            steps = 1
        elif owner is None:
            steps = parse_accumulation_steps(raw, "plugin_kwargs['num_steps']")
        else:
            steps = parse_accumulation_steps(raw, "num_steps", owner=owner)
        return cls(
            steps=steps,
            adjust_scheduler=bool(kwargs.get("adjust_scheduler", True)),
            sync_with_dataloader=bool(kwargs.get("sync_with_dataloader", True)),
            sync_each_batch=bool(kwargs.get("sync_each_batch", False)),
        )

    def to_kwargs(self) -> dict[str, Any]:
        """The fields that differ from the defaults, named as the plugin's fields."""
        kwargs: dict[str, Any] = {"num_steps": self.steps} if self.steps != 1 else {}
        if not self.adjust_scheduler:
            kwargs["adjust_scheduler"] = False
        if not self.sync_with_dataloader:
            kwargs["sync_with_dataloader"] = False
        if self.sync_each_batch:
            kwargs["sync_each_batch"] = True
        return kwargs


@runtime_checkable
class PlansAccumulation(Protocol):
    """Settings that state their plan without parsing again (accel-amp's plugin).

    ``GradientState`` stores ``to_plan()``'s result and ``to_kwargs()``'s fields; an object
    with ``to_kwargs()`` only (Accelerate's plugin) is read with
    :meth:`AccumulationPlan.from_kwargs`.
    """

    def to_plan(self) -> AccumulationPlan:
        """The plan of these settings."""
        ...

    def to_kwargs(self) -> dict[str, Any]:
        """The settings that differ from the defaults."""
        ...
