"""set_seed / synchronize_rng_state in one process, and save / load."""

from __future__ import annotations

import os
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from accel_state import (
    DistributedType,
    PartialState,
    clean_state_dict_for_safetensors,
    load,
    save,
    set_seed,
    synchronize_rng_state,
    synchronize_rng_states,
)


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "ACCEL_TORCH_DEVICE"):
        monkeypatch.delenv(key, raising=False)


def _hand_set(num_processes: int, process_index: int, local_process_index: int) -> None:
    PartialState()
    PartialState._shared_state.update(
        num_processes=num_processes,
        process_index=process_index,
        local_process_index=local_process_index,
        distributed_type=DistributedType.MULTI_CPU,
    )


def _draw() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


# --------------------------------------------------------------------------------------------
# set_seed
# --------------------------------------------------------------------------------------------


def test_set_seed_makes_random_numpy_and_torch_reproducible() -> None:
    set_seed(1234)
    first = _draw()
    set_seed(1234)
    assert _draw() == first
    set_seed(1235)
    other = _draw()
    assert other[0] != first[0] and other[1] != first[1] and other[2] != first[2]


def test_set_seed_large_seed_is_folded_for_numpy() -> None:
    set_seed(2**40 + 5)
    first = _draw()
    set_seed(2**40 + 5)
    assert _draw() == first


def test_device_specific_seed_adds_the_process_index() -> None:
    set_seed(43)
    expected = _draw()
    _hand_set(num_processes=2, process_index=1, local_process_index=1)
    set_seed(42, device_specific=True)
    assert _draw() == expected


def test_device_specific_seed_on_the_main_process_is_the_seed() -> None:
    set_seed(42)
    expected = _draw()
    set_seed(42, device_specific=True)
    assert _draw() == expected


def test_deterministic_asks_torch_for_deterministic_algorithms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[bool] = []
    monkeypatch.setattr(torch, "use_deterministic_algorithms", calls.append)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    # Unset for the test, and the value set_seed writes is removed after it: a plain
    # delenv of an unset variable would not be undone.
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    set_seed(0, deterministic=True)
    assert calls == [True]
    assert torch.backends.cudnn.deterministic is True
    assert torch.backends.cudnn.benchmark is False
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


@pytest.mark.parametrize("seed", ["42", 4.2, None, True])
def test_set_seed_rejects_non_integers(seed: Any) -> None:
    with pytest.raises(TypeError, match="seed"):
        set_seed(seed)


# --------------------------------------------------------------------------------------------
# synchronize_rng_state(s)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rng_type", [None, "torch"])
def test_synchronize_single_process_keeps_the_torch_state(rng_type: str | None) -> None:
    torch.manual_seed(7)
    torch.rand(5)
    state = torch.get_rng_state()
    expected = torch.rand(4).tolist()
    torch.set_rng_state(state)
    synchronize_rng_state(rng_type)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.rand(4).tolist() == expected


def test_synchronize_single_process_keeps_a_generator_state() -> None:
    generator = torch.Generator().manual_seed(11)
    torch.rand(3, generator=generator)
    state = generator.get_state()
    synchronize_rng_state("generator", generator=generator)
    assert torch.equal(generator.get_state(), state)
    synchronize_rng_states(["torch", "generator"], generator=generator)
    assert torch.equal(generator.get_state(), state)


def test_synchronize_unknown_rng_type_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="'numpy' is not a valid RNGType") as info:
        synchronize_rng_state("numpy")
    assert "generator" in str(info.value)


def test_synchronize_generator_without_generator() -> None:
    with pytest.raises(ValueError, match="generator=<torch.Generator>"):
        synchronize_rng_state("generator")


def test_synchronize_rng_type_missing_from_this_build() -> None:
    if hasattr(torch, "mlu"):
        pytest.skip("this torch build has an mlu module")
    with pytest.raises(ValueError, match="'mlu' is not available"):
        synchronize_rng_state("mlu")


# --------------------------------------------------------------------------------------------
# save / load
# --------------------------------------------------------------------------------------------


def test_save_load_round_trip_with_rng_states(tmp_path: Path) -> None:
    np.random.seed(3)
    obj = {
        "numpy": np.random.get_state(),
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "weights": {"w": torch.arange(4.0)},
        "array": np.arange(3, dtype=np.int64),
        "step": 5,
    }
    path = tmp_path / "state.pt"
    save(obj, path)
    loaded = load(path)  # weights_only=True by default
    assert loaded["step"] == 5
    assert loaded["python"] == obj["python"]
    assert torch.equal(loaded["torch"], obj["torch"])
    assert torch.equal(loaded["weights"]["w"], obj["weights"]["w"])
    np.testing.assert_array_equal(loaded["array"], obj["array"])
    np.random.set_state(loaded["numpy"])
    after_restore = np.random.rand(2)
    np.random.set_state(obj["numpy"])
    np.testing.assert_array_equal(after_restore, np.random.rand(2))
    assert sorted(os.listdir(tmp_path)) == ["state.pt"]


def test_load_refuses_arbitrary_objects_by_default(tmp_path: Path) -> None:
    path = tmp_path / "obj.pt"
    save({"when": Path("/tmp")}, path)
    with pytest.raises(Exception, match="weights_only"):
        load(path)
    assert load(path, weights_only=False) == {"when": Path("/tmp")}


def test_load_map_location(tmp_path: Path) -> None:
    path = tmp_path / "t.pt"
    save({"t": torch.ones(2)}, path)
    assert load(path, map_location="meta")["t"].device.type == "meta"


def test_save_safetensors_writes_metadata(tmp_path: Path) -> None:
    from safetensors import safe_open

    path = tmp_path / "model.safetensors"
    save(
        {"w": torch.arange(6.0).reshape(2, 3).t(), "b": torch.ones(2)},
        path,
        safe_serialization=True,
    )
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
        assert sorted(handle.keys()) == ["b", "w"]
        assert handle.get_tensor("w").tolist() == [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]


def test_save_safetensors_drops_exact_aliases_and_keeps_views(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from safetensors.torch import load_file

    base = torch.arange(6.0)
    state_dict = {
        "weight": base,
        "tied": base,  # exact alias: dropped
        "head": base[:3],  # shares storage, other shape: kept
        "tail": base[3:],  # shares storage, other offset: kept
        "other": torch.ones(2),
    }
    path = tmp_path / "tied.safetensors"
    with caplog.at_level("WARNING"):
        save(state_dict, path, safe_serialization=True)
    # Logged once, as Accelerate logs it (its suite counts the records).
    (record,) = caplog.records
    assert record.levelname == "WARNING"
    assert "Removed shared tensor ['tied']" in record.getMessage()
    loaded = load_file(str(path))
    assert sorted(loaded) == ["head", "other", "tail", "weight"]
    assert loaded["weight"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert loaded["head"].tolist() == [0.0, 1.0, 2.0]
    assert loaded["tail"].tolist() == [3.0, 4.0, 5.0]
    assert base.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # the input is untouched


def test_clean_state_dict_keeps_distinct_empty_tensors() -> None:
    state_dict = {"a": torch.zeros(0, 3), "b": torch.zeros(0, 3), "c": torch.ones(1)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cleaned = clean_state_dict_for_safetensors(state_dict)
    assert sorted(cleaned) == ["a", "b", "c"]


def test_clean_state_dict_passes_meta_and_non_tensor_values() -> None:
    meta = torch.empty(2, device="meta")
    cleaned = clean_state_dict_for_safetensors({"m": meta, "n": 3})
    assert cleaned["m"] is meta and cleaned["n"] == 3


@pytest.mark.parametrize(
    "obj",
    [{"a": torch.ones(1), "b": 3}, {"a": torch.ones(1), "b": [torch.ones(1)]}, [torch.ones(1)]],
)
def test_save_safetensors_rejects_non_tensors_and_leaves_no_file(tmp_path: Path, obj: Any) -> None:
    path = tmp_path / "bad.safetensors"
    with pytest.raises(TypeError, match="safe_serialization"):
        save(obj, path, safe_serialization=True)
    assert os.listdir(tmp_path) == []


def test_failed_save_leaves_no_temporary_and_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    save({"version": 1}, path)
    with pytest.raises(Exception):  # noqa: B017 - pickling a lambda fails in some way
        save({"version": 2, "fn": lambda: None}, path)
    assert os.listdir(tmp_path) == ["ckpt.pt"]
    assert load(path) == {"version": 1}


def test_save_on_a_non_main_process_writes_nothing(tmp_path: Path) -> None:
    _hand_set(num_processes=2, process_index=1, local_process_index=1)
    save({"a": torch.ones(1)}, tmp_path / "x.pt")
    save({"a": torch.ones(1)}, tmp_path / "x.safetensors", safe_serialization=True)
    save({"a": torch.ones(1)}, tmp_path / "y.pt", save_on_each_node=True)
    assert os.listdir(tmp_path) == []


def test_save_on_each_node_writes_on_local_main(tmp_path: Path) -> None:
    _hand_set(num_processes=4, process_index=2, local_process_index=0)
    save({"a": torch.ones(1)}, tmp_path / "x.pt")
    assert os.listdir(tmp_path) == []
    save({"a": torch.ones(1)}, tmp_path / "x.pt", save_on_each_node=True)
    assert os.listdir(tmp_path) == ["x.pt"]
