"""Every kwargs handler's ``to_kwargs`` against a default built in an empty environment.

``KwargsHandler.to_kwargs`` used to empty ``os.environ`` while it built the default it compares
with; it now blinds only its own thread's readers. These tests pin that the result is the same
for every handler accel ships, with each environment variable they read set, and that the
process environment is never written meanwhile.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, MutableMapping
from datetime import timedelta
from typing import Any

import pytest

from accel.utils import (
    AORecipeKwargs,
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
    TorchDynamoPlugin,
)
from accel_state import KwargsHandler
from accel_state.environment import clear_environment

#: Every variable a handler's default reads, set to something that is not the default.
VARIABLES = {
    "ACCEL_PROCESS_GROUP_TIMEOUT": "5",
    "ACCELERATE_DYNAMO_BACKEND": "eager",
    "ACCEL_DYNAMO_MODE": "max-autotune",
    "ACCEL_DYNAMO_USE_FULLGRAPH": "1",
    "ACCEL_DYNAMO_USE_DYNAMIC": "true",
    "ACCEL_DYNAMO_USE_REGIONAL_COMPILATION": "yes",
}

#: One handler of every class, built with defaults and with changed values.
HANDLERS: list[Callable[[], KwargsHandler]] = [
    InitProcessGroupKwargs,
    lambda: InitProcessGroupKwargs(backend="gloo"),
    lambda: InitProcessGroupKwargs(timeout=timedelta(seconds=600)),
    TorchDynamoPlugin,
    lambda: TorchDynamoPlugin(backend="no", mode="default", fullgraph=False),
    lambda: TorchDynamoPlugin(backend="inductor", dynamic=False),
    DistributedDataParallelKwargs,
    lambda: DistributedDataParallelKwargs(find_unused_parameters=True, comm_hook="fp16"),
    ProfileKwargs,
    lambda: ProfileKwargs(activities=["cpu"], record_shapes=True),
    AutocastKwargs,
    lambda: AutocastKwargs(enabled=False),
    GradScalerKwargs,
    lambda: GradScalerKwargs(init_scale=1024.0),
    GradientAccumulationPlugin,
    lambda: GradientAccumulationPlugin(num_steps=4),
    AORecipeKwargs,
    lambda: AORecipeKwargs(config="custom"),
]


class _RecordingEnviron(MutableMapping[str, str]):
    """A stand-in for ``os.environ`` that notes every write, delete and clear."""

    def __init__(self, values: dict[str, str]) -> None:
        self._values = dict(values)
        self.writes: list[str] = []

    def __getitem__(self, key: str) -> str:
        return self._values[key]

    def __setitem__(self, key: str, value: str) -> None:
        self.writes.append(f"set {key}")
        self._values[key] = value

    def __delitem__(self, key: str) -> None:
        self.writes.append(f"del {key}")
        del self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def clear(self) -> None:
        self.writes.append("clear")
        self._values.clear()


def _as_before(handler: KwargsHandler) -> dict[str, Any]:
    """What ``to_kwargs`` returned when it emptied ``os.environ`` to build the default."""
    with clear_environment():
        default = type(handler)().to_dict()
    changed = {k: v for k, v in handler.to_dict().items() if default.get(k) != v}
    if isinstance(handler, TorchDynamoPlugin):
        changed.pop("use_regional_compilation", None)
    return changed


@pytest.mark.parametrize("with_variables", [False, True], ids=["empty", "variables-set"])
@pytest.mark.parametrize("build", HANDLERS)
def test_to_kwargs_is_what_an_emptied_environment_gave(
    monkeypatch: pytest.MonkeyPatch, build: Callable[[], KwargsHandler], with_variables: bool
) -> None:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.replace("ACCEL_", "ACCELERATE_", 1), raising=False)
    if with_variables:
        for name, value in VARIABLES.items():
            monkeypatch.setenv(name, value)
    handler = build()
    expected = _as_before(handler)
    recorder = _RecordingEnviron(dict(os.environ))
    monkeypatch.setattr(os, "environ", recorder)
    assert handler.to_kwargs() == expected
    assert recorder.writes == []


def test_dynamo_plugin_from_the_environment_reports_what_it_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in VARIABLES.items():
        monkeypatch.setenv(name, value)
    assert TorchDynamoPlugin().to_kwargs() == {
        "backend": "eager",
        "mode": "max-autotune",
        "fullgraph": True,
        "dynamic": True,
    }
