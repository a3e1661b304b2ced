"""Kwargs handlers: InitProcessGroupKwargs defaults, validation and ``to_kwargs``."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterator, MutableMapping
from datetime import timedelta

import pytest

from accel_state import InitProcessGroupKwargs, KwargsHandler
from accel_state.environment import environment_hidden, read_variable


@pytest.fixture(autouse=True)
def _no_timeout_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCEL_PROCESS_GROUP_TIMEOUT", raising=False)


def test_defaults_nccl_600_seconds() -> None:
    kwargs = InitProcessGroupKwargs()
    assert kwargs.backend == "nccl"
    assert kwargs.init_method is None
    assert kwargs.timeout == timedelta(seconds=600)


@pytest.mark.parametrize("backend", ["gloo", "mpi", None])
def test_other_backends_default_to_1800_seconds(backend: str | None) -> None:
    assert InitProcessGroupKwargs(backend=backend).timeout == timedelta(seconds=1800)


def test_numbers_become_timedeltas() -> None:
    assert InitProcessGroupKwargs(timeout=30).timeout == timedelta(seconds=30)
    assert InitProcessGroupKwargs(timeout=0.5).timeout == timedelta(milliseconds=500)
    given = timedelta(minutes=2)
    assert InitProcessGroupKwargs(timeout=given).timeout == given


def test_to_dict_is_a_deep_copy() -> None:
    kwargs = InitProcessGroupKwargs(backend="gloo", init_method="tcp://127.0.0.1:1234")
    as_dict = kwargs.to_dict()
    assert as_dict == {
        "backend": "gloo",
        "init_method": "tcp://127.0.0.1:1234",
        "timeout": timedelta(seconds=1800),
    }
    as_dict["backend"] = "changed"
    assert kwargs.backend == "gloo"


def test_to_kwargs_default_instance_is_empty() -> None:
    assert InitProcessGroupKwargs().to_kwargs() == {}


def test_to_kwargs_only_fields_differing_from_the_default() -> None:
    # The default instance is nccl/600 s, so gloo's derived 1800 s differs too.
    assert InitProcessGroupKwargs(backend="gloo").to_kwargs() == {
        "backend": "gloo",
        "timeout": timedelta(seconds=1800),
    }
    assert InitProcessGroupKwargs(timeout=600).to_kwargs() == {}
    assert InitProcessGroupKwargs(init_method="file:///tmp/x").to_kwargs() == {
        "init_method": "file:///tmp/x"
    }


def test_timeout_from_the_environment_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_PROCESS_GROUP_TIMEOUT", "42.5")
    assert InitProcessGroupKwargs().timeout == timedelta(seconds=42.5)
    assert InitProcessGroupKwargs(backend="gloo").timeout == timedelta(seconds=42.5)
    # An explicit timeout wins over the environment.
    assert InitProcessGroupKwargs(timeout=7).timeout == timedelta(seconds=7)


def test_to_kwargs_compares_with_a_default_built_in_a_cleared_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ACCEL_PROCESS_GROUP_TIMEOUT", "5")
    kwargs = InitProcessGroupKwargs()
    assert kwargs.to_kwargs() == {"timeout": timedelta(seconds=5)}
    # The environment is back afterwards.
    assert os.environ["ACCEL_PROCESS_GROUP_TIMEOUT"] == "5"


@pytest.mark.parametrize("value", ["abc", "0", "-3", "nan", "inf"])
def test_bad_timeout_in_the_environment_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("ACCEL_PROCESS_GROUP_TIMEOUT", value)
    with pytest.raises(ValueError, match="ACCEL_PROCESS_GROUP_TIMEOUT"):
        InitProcessGroupKwargs()


@pytest.mark.parametrize("value", [-1, 0, -0.5, timedelta(seconds=-1), timedelta(0)])
def test_non_positive_timeout_is_a_value_error(value: object) -> None:
    with pytest.raises(ValueError, match="positive"):
        InitProcessGroupKwargs(timeout=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_timeout_is_a_value_error(value: float) -> None:
    with pytest.raises(ValueError, match="timeout"):
        InitProcessGroupKwargs(timeout=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["30", True, [30]])
def test_timeout_of_another_type_is_a_type_error(value: object) -> None:
    with pytest.raises(TypeError, match="timedelta"):
        InitProcessGroupKwargs(timeout=value)  # type: ignore[arg-type]


def test_kwargs_handler_works_for_any_dataclass() -> None:
    @dataclasses.dataclass
    class Handler(KwargsHandler):
        a: int = 1
        b: str = "x"
        c: list[int] = dataclasses.field(default_factory=list)

    assert Handler().to_kwargs() == {}
    assert Handler(a=2, c=[1]).to_kwargs() == {"a": 2, "c": [1]}


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


def test_to_kwargs_never_writes_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = _RecordingEnviron({**os.environ, "ACCEL_PROCESS_GROUP_TIMEOUT": "5"})
    monkeypatch.setattr(os, "environ", recorder)
    kwargs = InitProcessGroupKwargs()
    assert kwargs.timeout == timedelta(seconds=5)
    # Still compared with the default of an empty environment (600 s for nccl)...
    assert kwargs.to_kwargs() == {"timeout": timedelta(seconds=5)}
    assert InitProcessGroupKwargs(timeout=600).to_kwargs() == {}
    # ...yet built without emptying os.environ, which every other thread shares.
    assert recorder.writes == []


def test_no_other_thread_sees_an_emptied_environment_during_to_kwargs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ACCEL_PROCESS_GROUP_TIMEOUT", "5")
    monkeypatch.setenv("ACCEL_TEST_WATCHED", "here")
    stop = threading.Event()
    missing: list[str] = []

    def watch() -> None:
        # What a prefetch worker or a tracker does meanwhile: read the environment.
        while not stop.is_set():
            if os.environ.get("ACCEL_TEST_WATCHED") != "here":
                missing.append("ACCEL_TEST_WATCHED")
            if read_variable("ACCEL_PROCESS_GROUP_TIMEOUT") != "5":
                missing.append("ACCEL_PROCESS_GROUP_TIMEOUT")

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for _ in range(2000):
            assert InitProcessGroupKwargs().to_kwargs() == {"timeout": timedelta(seconds=5)}
    finally:
        stop.set()
        watcher.join()
    assert missing == []


def test_environment_hidden_blinds_this_thread_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_PROCESS_GROUP_TIMEOUT", "5")
    seen: list[str | None] = []
    with environment_hidden():
        assert read_variable("ACCEL_PROCESS_GROUP_TIMEOUT") is None
        assert InitProcessGroupKwargs().timeout == timedelta(seconds=600)
        # os.environ itself is whole, and another thread's readers see it.
        assert os.environ["ACCEL_PROCESS_GROUP_TIMEOUT"] == "5"
        other = threading.Thread(
            target=lambda: seen.append(read_variable("ACCEL_PROCESS_GROUP_TIMEOUT"))
        )
        other.start()
        other.join()
        # An explicit mapping is read as given.
        assert read_variable("ACCEL_PROCESS_GROUP_TIMEOUT", {"ACCEL_PROCESS_GROUP_TIMEOUT": "7"})
    assert seen == ["5"]
    assert read_variable("ACCEL_PROCESS_GROUP_TIMEOUT") == "5"


def test_environment_hidden_ends_with_its_block_even_on_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ACCEL_PROCESS_GROUP_TIMEOUT", "5")
    with pytest.raises(RuntimeError, match="inside"), environment_hidden():
        raise RuntimeError("inside")
    assert read_variable("ACCEL_PROCESS_GROUP_TIMEOUT") == "5"


def test_to_kwargs_default_ignores_a_bad_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    # The user's own handler, built with an explicit timeout, never reads the variable; the
    # default it is compared with must not read it either.
    kwargs = InitProcessGroupKwargs(timeout=30)
    monkeypatch.setenv("ACCEL_PROCESS_GROUP_TIMEOUT", "abc")
    assert kwargs.to_kwargs() == {"timeout": timedelta(seconds=30)}
