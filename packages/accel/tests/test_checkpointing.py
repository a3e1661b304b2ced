"""``save_state`` / ``load_state`` in one process (CPU).

Covers Accelerate's checkpoint layout (file names, ``_<i>`` suffixes, ``pytorch_model.bin``
without safetensors) plus accel's manifest; automatic naming with ``total_limit`` (Accelerate's
golden: 11 saves keep ``checkpoint_9`` and ``checkpoint_10``); round trips of every prepared
object; ``register_for_checkpointing`` and the pre-hooks; integrity checks that refuse a bad
checkpoint before changing anything (truncated, missing or resized files, another model's
shapes, a pickle that would run code); crash safety (a save that fails part way leaves the
previous checkpoints loadable and no visible half checkpoint); DDP / compile key prefixes;
exact resume of a shuffled, dropout, accumulating, mixed-precision loop; and ``save_model``.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accel.checkpoint_writing
import accel.checkpointing
from accel.accelerator import Accelerator
from accel.checkpointing import CheckpointError
from accel.handlers import ProjectConfiguration
from accel_data import DataLoaderConfiguration
from accel_state import AcceleratorState, GradientState

# --- helpers ------------------------------------------------------------------------------


class _Counter:
    """A custom object for ``register_for_checkpointing``: micro-steps done so far."""

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = int(state["n"])


class _NoState:
    """Lacks ``state_dict`` / ``load_state_dict``."""


class _RunsCode:
    """Unpickling this runs a shell command (what ``weights_only=True`` must refuse)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (self.command,))


def _data(n: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(
        n, 1, generator=generator
    )
    return x, y


def _net(seed: int = 0, hidden: int = 8) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def _setup(
    accelerator: Accelerator,
    *,
    custom: Any = None,
    hidden: int = 8,
    seed: int = 0,
) -> tuple[Any, Any, Any, Any]:
    """Prepare a model, AdamW, StepLR and a shuffled loader; register ``custom`` if given."""
    model = _net(seed, hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    if custom is not None:
        accelerator.register_for_checkpointing(custom)
    return accelerator.prepare(model, optimizer, loader, scheduler)


def _train_steps(
    accelerator: Accelerator, model: Any, optimizer: Any, loader: Any, scheduler: Any, steps: int
) -> None:
    done = 0
    while done < steps:
        for xb, yb in loader:
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(xb), yb)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            done += 1
            if done == steps:
                return


def _clone_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _assert_state_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def _files(directory: str | Path) -> set[str]:
    return {p.name for p in Path(directory).iterdir()}


def _refresh_manifest(directory: Path) -> None:
    """Rewrite the manifest's sizes after a test changed a file on purpose."""
    path = directory / "accel_manifest.json"
    manifest = json.loads(path.read_text())
    for name in manifest["files"]:
        manifest["files"][name]["size"] = (directory / name).stat().st_size
    path.write_text(json.dumps(manifest))


def _auto(tmp_path: Path, total_limit: int | None = None) -> ProjectConfiguration:
    return ProjectConfiguration(
        project_dir=os.fspath(tmp_path), automatic_checkpoint_naming=True, total_limit=total_limit
    )


def _checkpoints(tmp_path: Path) -> list[str]:
    base = tmp_path / "checkpoints"
    return sorted(p.name for p in base.iterdir()) if base.exists() else []


# --- layout -------------------------------------------------------------------------------


BASE_FILES = {
    "model.safetensors",
    "optimizer.bin",
    "scheduler.bin",
    "dl_state_dict.bin",
    "random_states_0.pkl",
    "custom_checkpoint_0.pkl",
    "accel_manifest.json",
}


def test_layout_has_accelerates_file_names_and_a_manifest(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    model, optimizer, loader, scheduler = _setup(accelerator, custom=_Counter(3))
    _train_steps(accelerator, model, optimizer, loader, scheduler, 3)
    target = tmp_path / "ckpt"
    returned = accelerator.save_state(target)

    assert returned == os.fspath(target.absolute())
    assert Path(returned).is_dir()
    assert _files(target) == BASE_FILES | {"scaler.pt"}
    # No hidden directory is left next to it.
    assert _files(tmp_path) == {"ckpt"}

    manifest = json.loads((target / "accel_manifest.json").read_text())
    listed = manifest["files"]
    assert set(listed) == _files(target) - {"accel_manifest.json"}
    for name, entry in listed.items():
        assert entry["size"] == (target / name).stat().st_size, name

    scale = accelerator.scaler.get_scale()
    accelerator.scaler.update(new_scale=scale / 8)
    accelerator.load_state(target)
    assert accelerator.scaler.get_scale() == scale


def test_layout_adds_partial_gradients_only_mid_accumulation_window(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3)
    model, optimizer, loader, scheduler = _setup(accelerator)
    _train_steps(accelerator, model, optimizer, loader, scheduler, 3)  # window closed
    assert "accel_gradients_0.safetensors" not in _files(accelerator.save_state(tmp_path / "a"))
    _train_steps(accelerator, model, optimizer, loader, scheduler, 1)  # 1 of 3 in the window
    files = _files(accelerator.save_state(tmp_path / "b"))
    assert files == (BASE_FILES - {"custom_checkpoint_0.pkl"}) | {"accel_gradients_0.safetensors"}


def test_layout_numbers_the_second_model_and_optimizer(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    first, second = _net(0), _net(1)
    prepared = accelerator.prepare(
        first,
        torch.optim.SGD(first.parameters(), lr=0.1),
        second,
        torch.optim.SGD(second.parameters(), lr=0.1),
    )
    assert len(prepared) == 4
    target = accelerator.save_state(tmp_path / "two")
    assert _files(target) == {
        "model.safetensors",
        "model_1.safetensors",
        "optimizer.bin",
        "optimizer_1.bin",
        "random_states_0.pkl",
        "accel_manifest.json",
    }
    weights = [_clone_state(prepared[0]), _clone_state(prepared[2])]
    with torch.no_grad():
        for model in (prepared[0], prepared[2]):
            for p in model.parameters():
                p.zero_()
    accelerator.load_state(target)
    _assert_state_equal(_clone_state(prepared[0]), weights[0])
    _assert_state_equal(_clone_state(prepared[2]), weights[1])


def test_layout_without_safetensors_writes_pytorch_model_bin(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    model, *_ = _setup(accelerator)
    before = _clone_state(model)
    target = accelerator.save_state(tmp_path / "bin", safe_serialization=False)
    files = _files(target)
    assert "pytorch_model.bin" in files
    assert "model.safetensors" not in files
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    accelerator.load_state(target)
    _assert_state_equal(_clone_state(model), before)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


@pytest.mark.filterwarnings("ignore:Removed shared tensor")
def test_tied_weights_round_trip_and_stay_tied(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(_Tied())
    weight = model.embed.weight.detach().clone()
    target = accelerator.save_state(tmp_path / "tied")
    with torch.no_grad():
        model.embed.weight.add_(1.0)
    accelerator.load_state(target)
    assert torch.equal(model.embed.weight, weight)
    assert model.head.weight is model.embed.weight


def test_saving_onto_a_file_is_refused(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(ValueError, match="is a file"):
        accelerator.save_state(tmp_path / "taken")
    assert (tmp_path / "taken").read_text() == "a file"


# --- automatic naming ---------------------------------------------------------------------


def test_total_limit_two_after_eleven_saves_keeps_checkpoints_9_and_10(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True, project_config=_auto(tmp_path, total_limit=2))
    _setup(accelerator)
    for _ in range(11):
        accelerator.save_state()
    assert _checkpoints(tmp_path) == ["checkpoint_10", "checkpoint_9"]
    assert accelerator.save_iteration == 11


def test_iteration_increments_for_explicit_directories_too(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True, project_config=_auto(tmp_path))
    _setup(accelerator)
    accelerator.save_state()
    accelerator.save_state(tmp_path / "elsewhere")  # ignored with automatic naming ...
    assert accelerator.save_iteration == 2  # ... but it still counts (Accelerate quirk)
    accelerator.save_state()
    assert _checkpoints(tmp_path) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]

    plain = Accelerator(cpu=True)
    plain.save_state(tmp_path / "x")
    plain.save_state(tmp_path / "y")
    assert plain.save_iteration == 2


def test_existing_numbered_checkpoint_is_refused(tmp_path: Path) -> None:
    (tmp_path / "checkpoints" / "checkpoint_0").mkdir(parents=True)
    accelerator = Accelerator(cpu=True, project_config=_auto(tmp_path))
    _setup(accelerator)
    with pytest.raises(ValueError, match="already exists"):
        accelerator.save_state()
    assert accelerator.save_iteration == 0


def test_save_and_load_without_a_directory_need_automatic_naming(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True, project_dir=tmp_path)
    _setup(accelerator)
    with pytest.raises(ValueError):
        accelerator.save_state()
    with pytest.raises(ValueError):
        accelerator.load_state()
    with pytest.raises(ValueError):
        accelerator.load_state(tmp_path / "does-not-exist")
    assert not (tmp_path / "checkpoints").exists()


def test_load_without_directory_picks_the_newest_and_ignores_incomplete_ones(
    tmp_path: Path,
) -> None:
    accelerator = Accelerator(cpu=True, project_config=_auto(tmp_path))
    model, *_ = _setup(accelerator)
    for value in (1.0, 2.0, 3.0):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(value)
        accelerator.save_state()
    # A hidden half-written checkpoint with a higher number (a crashed save).
    hidden = tmp_path / "checkpoints" / ".checkpoint_5.incomplete"
    hidden.mkdir()
    (hidden / "model.safetensors").write_bytes(b"garbage")

    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.0)
    loaded = accelerator.load_state()
    assert loaded == os.fspath(tmp_path / "checkpoints" / "checkpoint_2")
    assert all(torch.all(p == 3.0) for p in model.parameters())

    accelerator.save_state()  # the next save cleans the leftover up
    assert _checkpoints(tmp_path) == [f"checkpoint_{i}" for i in range(4)]


# --- round trip ---------------------------------------------------------------------------


def test_round_trip_restores_every_object_exactly(tmp_path: Path) -> None:
    counter = _Counter()
    accelerator = Accelerator(cpu=True)
    model, optimizer, loader, scheduler = _setup(accelerator, custom=counter)
    _train_steps(accelerator, model, optimizer, loader, scheduler, 5)
    counter.n = 5
    weights = _clone_state(model)
    opt_state = copy.deepcopy(optimizer.state_dict())
    sched_state = scheduler.state_dict()
    step = accelerator.step
    assert step == 5
    target = accelerator.save_state(tmp_path / "ckpt")

    _train_steps(accelerator, model, optimizer, loader, scheduler, 6)
    counter.n = 99
    accelerator.step = 42
    assert not torch.equal(_clone_state(model)["0.weight"], weights["0.weight"])
    assert scheduler.state_dict() != sched_state

    assert accelerator.load_state(target) == target
    _assert_state_equal(_clone_state(model), weights)
    restored = optimizer.state_dict()
    assert restored["param_groups"] == opt_state["param_groups"]
    for i in range(4):
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(restored["state"][i][name], opt_state["state"][i][name])
    assert scheduler.state_dict() == sched_state
    assert counter.n == 5
    assert accelerator.step == step


# --- register_for_checkpointing -----------------------------------------------------------


def test_register_for_checkpointing_refuses_objects_without_state_dict() -> None:
    accelerator = Accelerator(cpu=True)
    with pytest.raises(ValueError, match="Item at index 1") as info:
        accelerator.register_for_checkpointing(_Counter(), _NoState())
    assert "Item at index 0" not in str(info.value)
    assert accelerator._custom_objects == []


def test_loading_with_another_number_of_registered_objects_fails(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    _setup(accelerator, custom=_Counter(1))
    target = accelerator.save_state(tmp_path / "ckpt")
    accelerator.register_for_checkpointing(_Counter(2))
    with pytest.raises(CheckpointError, match="custom") as info:
        accelerator.load_state(target)
    assert isinstance(info.value, RuntimeError)


# --- pre-hooks ----------------------------------------------------------------------------


def test_save_pre_hook_sees_the_models_and_can_add_or_skip_files(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    model, *_ = _setup(accelerator)
    calls: list[tuple[Any, ...]] = []

    def hook(models: list[Any], weights: list[Any], output_dir: str) -> None:
        calls.append((list(models), len(weights), output_dir))
        assert set(weights[0]) == set(model.state_dict())
        Path(output_dir, "extra.json").write_text('{"hooked": true}')
        weights[0] = None

    handle = accelerator.register_save_state_pre_hook(hook)
    target = Path(accelerator.save_state(tmp_path / "hooked"))
    assert len(calls) == 1
    assert calls[0][0] == [model]
    assert calls[0][1] == 1
    assert Path(calls[0][2]).parent == tmp_path  # the directory being assembled
    files = _files(target)
    assert "extra.json" in files
    assert "model.safetensors" not in files
    assert "extra.json" in json.loads((target / "accel_manifest.json").read_text())["files"]

    handle.remove()
    files = _files(accelerator.save_state(tmp_path / "plain"))
    assert len(calls) == 1
    assert "extra.json" not in files
    assert "model.safetensors" in files


def test_load_pre_hook_receives_models_and_input_dir(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    model, *_ = _setup(accelerator)
    target = accelerator.save_state(tmp_path / "ckpt")
    calls: list[tuple[list[Any], str]] = []
    handle = accelerator.register_load_state_pre_hook(
        lambda models, input_dir: calls.append((list(models), input_dir))
    )
    accelerator.load_state(target)
    assert calls == [([model], target)]
    handle.remove()
    accelerator.load_state(target)
    assert len(calls) == 1


def test_load_pre_hook_popping_models_loads_them_itself_and_keeps_them_prepared(
    tmp_path: Path,
) -> None:
    accelerator = Accelerator(cpu=True)
    model, *_ = _setup(accelerator)
    target = accelerator.save_state(tmp_path / "ckpt")
    replacement = _clone_state(_net(9))

    def load_hook(models: list[Any], input_dir: str) -> None:
        while models:  # diffusers: "pop models so that they are not loaded again"
            models.pop().load_state_dict(replacement)

    accelerator.register_load_state_pre_hook(load_hook)
    accelerator.load_state(target)
    _assert_state_equal(_clone_state(model), replacement)  # the checkpoint did not overwrite it
    assert accelerator._models == [model]
    assert "model.safetensors" in _files(accelerator.save_state(tmp_path / "again"))


# --- integrity and bad input ----------------------------------------------------------------


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Accelerator, Any, Path]:
    """A prepared run with a checkpoint in ``tmp_path/ckpt``, then its weights changed."""
    accelerator = Accelerator(cpu=True)
    model, optimizer, loader, scheduler = _setup(accelerator, custom=_Counter(4))
    _train_steps(accelerator, model, optimizer, loader, scheduler, 2)
    target = Path(accelerator.save_state(tmp_path / "ckpt"))
    _train_steps(accelerator, model, optimizer, loader, scheduler, 2)
    return accelerator, model, target


def _assert_refused(
    accelerator: Accelerator, model: Any, target: Path, *fragments: str
) -> CheckpointError:
    before = _clone_state(model)
    with pytest.raises(CheckpointError) as info:
        accelerator.load_state(target)
    for fragment in fragments:
        assert fragment in str(info.value)
    _assert_state_equal(_clone_state(model), before)
    return info.value


def test_truncated_weights_are_refused_naming_the_file(saved: tuple[Any, Any, Path]) -> None:
    accelerator, model, target = saved
    path = target / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 16])
    _assert_refused(accelerator, model, target, "model.safetensors")
    # Without the manifest (an Accelerate checkpoint), the safetensors header check catches it.
    (target / "accel_manifest.json").unlink()
    _assert_refused(accelerator, model, target, "model.safetensors", "truncated")


def test_missing_optimizer_is_refused_naming_the_file(saved: tuple[Any, Any, Path]) -> None:
    accelerator, model, target = saved
    (target / "optimizer.bin").unlink()
    _assert_refused(accelerator, model, target, "optimizer.bin", "missing")
    (target / "accel_manifest.json").unlink()
    _assert_refused(accelerator, model, target, "optimizer.bin", "missing")


def test_manifest_size_mismatch_is_refused(saved: tuple[Any, Any, Path]) -> None:
    accelerator, model, target = saved
    with open(target / "scheduler.bin", "ab") as stream:
        stream.write(b"\0")
    _assert_refused(accelerator, model, target, "scheduler.bin", "accel_manifest.json")


@pytest.mark.parametrize("where", ["invalid", "gpu0", 1.5, {"cuda:0": "cpu"}, True])
def test_an_unsupported_map_location_is_refused_before_anything_is_read(
    saved: tuple[Any, Any, Path], where: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    accelerator, model, target = saved
    before = _clone_state(model)
    calls: list[str] = []
    for hook in ("register_load_state_pre_hook",):
        getattr(accelerator, hook)(lambda models, directory: calls.append(directory))
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append("torch.load"))
    with pytest.raises(TypeError, match="Unsupported optimizer map location passed") as info:
        accelerator.load_state(target, map_location=where)
    assert repr(where) in str(info.value) and "'on_device'" in str(info.value)
    assert calls == []  # neither a hook nor a read ran
    _assert_state_equal(_clone_state(model), before)


@pytest.mark.parametrize("where", [None, "cpu", "on_device", torch.device("cpu"), "cpu:0"])
def test_supported_map_locations_load(saved: tuple[Any, Any, Path], where: Any) -> None:
    accelerator, model, target = saved
    accelerator.load_state(target, map_location=where)
    assert accelerator.load_state(target, load_kwargs={"map_location": where}) == str(target)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_map_location_places_the_optimizer_state_on_the_gpu(tmp_path: Path) -> None:
    accelerator = Accelerator()
    model, optimizer, loader, scheduler = _setup(accelerator)
    _train_steps(accelerator, model, optimizer, loader, scheduler, 2)
    target = accelerator.save_state(tmp_path / "ckpt")
    before = _clone_state(model)
    for where in ("on_device", "cpu", None, "cuda:0", torch.device("cuda", 0)):
        accelerator.load_state(target, map_location=where)
        # torch's load_state_dict puts the state beside its parameters, wherever it was read.
        state = next(iter(optimizer.state_dict()["state"].values()))
        tensors = [value for value in state.values() if torch.is_tensor(value) and value.ndim]
        assert tensors and all(value.device.type == "cuda" for value in tensors), where
        _assert_state_equal(_clone_state(model), before)
    with pytest.raises(TypeError, match="Unsupported optimizer map location passed"):
        accelerator.load_state(target, map_location="invalid")


def test_checkpoint_of_another_shape_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(nn.Linear(4, 8))
    target = Path(accelerator.save_state(tmp_path / "small"))

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(nn.Linear(4, 9))
    error = _assert_refused(accelerator, model, target, "model.safetensors", "'weight'")
    assert "(8, 4)" in str(error)
    assert "(9, 4)" in str(error)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_pickle_that_runs_code_is_refused_and_never_runs(
    saved: tuple[Any, Any, Path], tmp_path: Path
) -> None:
    accelerator, model, target = saved
    side_effect = tmp_path / "pwned"
    torch.save(_RunsCode(f"touch {side_effect}"), target / "custom_checkpoint_0.pkl")
    _refresh_manifest(target)
    counter = accelerator._custom_objects[0]
    _assert_refused(accelerator, model, target, "custom_checkpoint_0.pkl", "weights_only")
    assert not side_effect.exists()
    assert counter.n == 4  # untouched by the refused load

    # A plain pickle (not torch's zip format) is refused too.
    with open(target / "custom_checkpoint_0.pkl", "wb") as stream:
        pickle.dump(_RunsCode(f"touch {side_effect}"), stream)
    _refresh_manifest(target)
    _assert_refused(accelerator, model, target, "custom_checkpoint_0.pkl")
    assert not side_effect.exists()


def test_corrupt_manifest_is_refused(saved: tuple[Any, Any, Path]) -> None:
    accelerator, model, target = saved
    (target / "accel_manifest.json").write_text("{not json")
    _assert_refused(accelerator, model, target, "accel_manifest.json")


def test_mismatched_loader_state_is_refused_before_anything_changes(tmp_path: Path) -> None:
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True)
    )
    model, optimizer, loader, scheduler = _setup(accelerator)
    _train_steps(accelerator, model, optimizer, loader, scheduler, 1)
    target = Path(accelerator.save_state(tmp_path / "seedable"))

    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True)  # the same loader, without the seedable sampler
    model, *_ = _setup(accelerator, seed=3)
    _assert_refused(accelerator, model, target, "dl_state_dict.bin")


# --- crash safety -------------------------------------------------------------------------


def _fail_after(calls: int, real: Any) -> Any:
    count = {"n": 0}

    def flaky(*args: Any, **kwargs: Any) -> Any:
        count["n"] += 1
        if count["n"] > calls:
            raise OSError("disk full (injected)")
        return real(*args, **kwargs)

    return flaky


def test_a_failing_save_leaves_the_previous_checkpoint_loadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counter = _Counter(7)
    accelerator = Accelerator(cpu=True, project_config=_auto(tmp_path))
    model, optimizer, loader, scheduler = _setup(accelerator, custom=counter)
    _train_steps(accelerator, model, optimizer, loader, scheduler, 2)
    weights = _clone_state(model)
    accelerator.save_state()

    _train_steps(accelerator, model, optimizer, loader, scheduler, 2)
    counter.n = 8
    real = accel.checkpoint_writing._torch_save
    monkeypatch.setattr(accel.checkpoint_writing, "_torch_save", _fail_after(2, real))
    with pytest.raises(OSError, match="injected"):
        accelerator.save_state()
    monkeypatch.setattr(accel.checkpoint_writing, "_torch_save", real)

    names = _checkpoints(tmp_path)
    assert [n for n in names if not n.startswith(".")] == ["checkpoint_0"]
    assert set(names) <= {"checkpoint_0", ".checkpoint_1.incomplete"}
    assert accelerator.save_iteration == 1

    assert accelerator.load_state().endswith("checkpoint_0")
    _assert_state_equal(_clone_state(model), weights)
    assert counter.n == 7

    accelerator.save_state()
    assert _checkpoints(tmp_path) == ["checkpoint_0", "checkpoint_1"]


def test_a_failing_manifest_write_never_prunes_the_last_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    accelerator = Accelerator(cpu=True, project_config=_auto(tmp_path, total_limit=1))
    _setup(accelerator)
    accelerator.save_state()

    def broken(directory: Path) -> None:
        raise OSError("manifest write failed (injected)")

    monkeypatch.setattr(accel.checkpoint_writing, "_write_manifest", broken)
    for _ in range(2):
        with pytest.raises(OSError, match="injected"):
            accelerator.save_state()
    visible = [n for n in _checkpoints(tmp_path) if not n.startswith(".")]
    assert visible == ["checkpoint_0"]
    assert "accel_manifest.json" in _files(tmp_path / "checkpoints" / "checkpoint_0")
    accelerator.load_state()

    monkeypatch.undo()
    accelerator.save_state()
    assert _checkpoints(tmp_path) == ["checkpoint_1"]


def test_an_explicit_directory_saved_again_is_replaced_completely(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, optimizer, loader, scheduler = _setup(accelerator)
    _train_steps(accelerator, model, optimizer, loader, scheduler, 1)  # mid window
    target = tmp_path / "ckpt"
    handle = accelerator.register_save_state_pre_hook(
        lambda models, weights, output_dir: Path(output_dir, "stale.txt").write_text("old")
    )
    accelerator.save_state(target)
    assert {"stale.txt", "accel_gradients_0.safetensors"} <= _files(target)

    handle.remove()
    _train_steps(accelerator, model, optimizer, loader, scheduler, 1)  # window closed
    weights = _clone_state(model)
    accelerator.save_state(target)
    files = _files(target)
    assert "stale.txt" not in files
    assert "accel_gradients_0.safetensors" not in files
    assert set(json.loads((target / "accel_manifest.json").read_text())["files"]) == files - {
        "accel_manifest.json"
    }
    assert _files(tmp_path) == {"ckpt"}  # neither hidden leftover nor the replaced copy
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    accelerator.load_state(target)
    _assert_state_equal(_clone_state(model), weights)


def test_saving_into_a_directory_with_unrelated_files_never_deletes_them(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    _setup(accelerator)
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("keep me")
    (run / "tokenizer").mkdir()
    (run / "tokenizer" / "vocab.json").write_text("{}")
    with pytest.raises(ValueError, match="not an accel or Accelerate checkpoint"):
        accelerator.save_state(run)
    assert (run / "notes.txt").read_text() == "keep me"
    assert (run / "tokenizer" / "vocab.json").exists()
    assert not list(tmp_path.glob(".run.*"))  # refused before anything was written


def test_saving_into_the_working_directory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    accelerator = Accelerator(cpu=True)
    _setup(accelerator)
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    for target in (".", "..", tmp_path):
        with pytest.raises(ValueError, match="working directory"):
            accelerator.save_state(target)
    assert (tmp_path / "work").is_dir()


# --- DDP / compile prefixes -----------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod."])
def test_prefixed_weights_load_into_a_plain_model(tmp_path: Path, prefix: str) -> None:
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(_net(0))
    target = Path(accelerator.save_state(tmp_path / "ckpt"))
    source = _net(5)
    (target / "accel_manifest.json").unlink()  # hand-written, as from Accelerate
    save_file(
        {prefix + k: v.contiguous() for k, v in source.state_dict().items()},
        target / "model.safetensors",
        metadata={"format": "pt"},
    )
    accelerator.load_state(target)
    _assert_state_equal(_clone_state(model), _clone_state(source))


# --- exact resume in one process ------------------------------------------------------------

TOTAL_MICRO_STEPS = 40
NUM_SAMPLES = 44  # 11 batches of 4: epochs and accumulation windows of 3 do not line up


def _dropout_net() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))


def _resume_loop(
    project_dir: Path, mixed_precision: str, seedable: bool, stop_at: int | None, resume: bool
) -> dict[str, torch.Tensor] | None:
    """Train a shuffled dropout net; stop and save after ``stop_at`` micro-steps, or resume."""
    AcceleratorState._reset_state()
    GradientState._reset_state()
    random.seed(0)
    torch.manual_seed(0)
    accelerator = Accelerator(
        cpu=True,
        mixed_precision=mixed_precision,
        gradient_accumulation_steps=3,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=seedable),
        project_config=_auto(project_dir),
    )
    model = _dropout_net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    x, y = _data(NUM_SAMPLES, seed=3)
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    counter = _Counter()
    accelerator.register_for_checkpointing(counter)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if resume:
        accelerator.load_state()
    while counter.n < TOTAL_MICRO_STEPS:
        for xb, yb in loader:
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(xb), yb)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            counter.n += 1
            if counter.n == stop_at:
                accelerator.save_state()
                return None
            if counter.n == TOTAL_MICRO_STEPS:
                break
    return _clone_state(accelerator.unwrap_model(model))


@pytest.mark.parametrize(
    ("mixed_precision", "seedable"), [("bf16", True), ("no", False)], ids=["bf16-seedable", "no"]
)
def test_resume_from_any_micro_step_is_bit_exact(
    tmp_path: Path, mixed_precision: str, seedable: bool
) -> None:
    reference = _resume_loop(tmp_path / "reference", mixed_precision, seedable, None, False)
    assert reference is not None
    assert not torch.equal(reference["0.weight"], _dropout_net()[0].weight.detach())
    for stop_at in (5, 11, 13, 17, 29):  # 5, 13, 29 mid-window; 11 at the epoch's end
        run_dir = tmp_path / f"stop{stop_at}"
        assert _resume_loop(run_dir, mixed_precision, seedable, stop_at, False) is None
        files = _files(run_dir / "checkpoints" / "checkpoint_0")
        assert ("accel_gradients_0.safetensors" in files) == (stop_at in (5, 13, 29))
        resumed = _resume_loop(run_dir, mixed_precision, seedable, None, True)
        assert resumed is not None
        for key, value in reference.items():
            assert torch.equal(resumed[key], value), (stop_at, key)


# --- save_model -------------------------------------------------------------------------------


def test_save_model_writes_one_loadable_file(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(_net(0))
    accelerator.save_model(model, tmp_path / "out")
    assert _files(tmp_path / "out") == {"model.safetensors"}
    _assert_state_equal(
        load_file(tmp_path / "out" / "model.safetensors"),
        _clone_state(accelerator.unwrap_model(model)),
    )


def test_save_model_shards_above_max_shard_size(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(_net(0, hidden=32))
    accelerator.save_model(model, tmp_path / "out", max_shard_size=300)
    files = _files(tmp_path / "out")
    shards = sorted(f for f in files if f.startswith("model-"))
    assert len(shards) >= 2
    assert files == set(shards) | {"model.safetensors.index.json"}
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    merged: dict[str, torch.Tensor] = {}
    for shard in shards:
        merged.update(load_file(tmp_path / "out" / shard))
    assert set(index["weight_map"].values()) == set(shards)
    assert set(index["weight_map"]) == set(merged)
    _assert_state_equal(merged, _clone_state(accelerator.unwrap_model(model)))


def test_loading_an_automatic_checkpoint_continues_its_numbering(tmp_path: Path) -> None:
    def fresh() -> Accelerator:
        AcceleratorState._reset_state()
        GradientState._reset_state()
        config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
        accelerator = Accelerator(cpu=True, project_config=config)
        _setup(accelerator)
        return accelerator

    first = fresh()
    for _ in range(3):
        first.save_state()
    resumed = fresh()  # a new run: numbering starts at 0 ...
    assert resumed.load_state().endswith("checkpoint_2")
    # ... and continues after the checkpoint it resumed from instead of colliding with it.
    assert resumed.save_state().endswith("checkpoint_3")
