"""DevicePlan: a device map parsed once at the door, its lookups, and the walks that use it."""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import accel_bigmodel
from accel_bigmodel import device_plan as device_plan_module
from accel_bigmodel.device_plan import DevicePlan, ExecutionDevice
from accel_bigmodel.dispatch import dispatch_model, load_checkpoint_and_dispatch
from accel_bigmodel.empty_init import init_empty_weights
from accel_bigmodel.hooks import AlignDevicesHook, add_hook_to_module, find_align_devices_hook
from accel_bigmodel.hooks import align as align_module
from accel_bigmodel.loading import load_checkpoint_in_model

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
CUDA1 = torch.device("cuda", 1)

# Written for another machine: the lookups do not need the accelerators.
GOLDEN = {"": "cpu", "a": "cuda:1", "a.b": "cuda:1", "c": "disk", "d": "meta"}


def _golden() -> DevicePlan:
    return DevicePlan.from_device_map(GOLDEN, on_this_machine=False)


# -- the plan itself ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "key", "placement"),
    [
        ("a.b.weight", "a.b", CUDA1),
        ("a.weight", "a", CUDA1),
        ("ab.weight", "", CPU),  # a prefix ends at a dot
        ("c", "c", "disk"),
        ("c.0.bias", "c", "disk"),
        ("d.x", "d", torch.device("meta")),
        ("e.weight", "", CPU),
    ],
)
def test_longest_prefix_lookup(name: str, key: str, placement: Any) -> None:
    plan = _golden()
    assert plan.key_of(name) == key
    assert plan.placement_of(name) == placement
    assert plan.on_disk(name) is (placement == "disk")


def test_a_name_no_entry_places_has_no_placement() -> None:
    plan = DevicePlan.from_device_map({"a": "cpu"})
    assert plan.key_of("b.weight") is None and plan.placement_of("b.weight") is None
    assert not plan.on_disk("b.weight")


def test_predicates_read_the_parsed_devices() -> None:
    plan = _golden()
    assert plan.placements == {
        "": CPU,
        "a": CUDA1,
        "a.b": CUDA1,
        "c": "disk",
        "d": torch.device("meta"),
    }
    assert plan.device_map == GOLDEN and plan.strategy is None
    assert plan.disk_keys == ["c"] and plan.has_disk
    assert plan.keys_on("cuda") == ["a", "a.b"] and plan.keys_on("meta") == ["d"]
    assert plan.offloaded_to == ["disk", "cpu"]
    assert plan.needs_hooks and plan.one_device is None
    assert not DevicePlan.from_device_map({"": "cpu"}).has_disk


@pytest.mark.parametrize(
    ("device_map", "needs_hooks", "one_device"),
    [
        ({"": "cpu"}, False, CPU),
        ({"a": "cuda", "b": "cuda:0"}, False, torch.device("cuda")),  # one device, two spellings
        ({"a": "cpu", "b": "meta"}, True, None),
        ({"": "disk"}, True, None),  # disk alone still needs hooks to bring weights in
        ({}, False, None),  # nothing to move
    ],
)
def test_one_device(
    device_map: dict[str, str], needs_hooks: bool, one_device: torch.device | None
) -> None:
    plan = DevicePlan.from_device_map(device_map, on_this_machine=False)
    assert plan.needs_hooks is needs_hooks
    assert plan.one_device == one_device


def test_main_device_execution_devices_and_offload_flags() -> None:
    plan = DevicePlan.from_device_map(
        {"a": "cpu", "b": 1, "c": "disk", "d": "cuda:1"}, on_this_machine=False
    )
    main = plan.default_main_device()
    assert main.given == 1 and main.device.index == 1  # as written: 1 stays 1
    assert plan.execution_devices(main) == {
        "a": main,
        "b": main,
        "c": main,
        "d": ExecutionDevice("cuda:1", CUDA1),
        "": main,
    }
    assert plan.offload_flags(main.device) == {"a": True, "b": False, "c": True, "d": False}
    for main_device in (CPU, torch.device("mps"), None):
        flags = plan.offload_flags(main_device)
        assert flags == {"a": False, "b": False, "c": True, "d": False}
    cpu_only = DevicePlan.from_device_map({"a": "cpu", "b": "disk"})
    assert cpu_only.default_main_device() == ExecutionDevice("cpu", CPU)


def test_the_plan_is_frozen_and_keeps_a_copy_of_the_map() -> None:
    device_map: dict[str, Any] = {"a": "cpu", "b": "disk"}
    plan = DevicePlan.from_device_map(device_map)
    device_map["b"] = "cpu"
    assert plan.device_map == {"a": "cpu", "b": "disk"} and plan.has_disk
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.strategy = "auto"  # type: ignore[misc]
    with pytest.raises(TypeError):
        plan.placements["a"] = "disk"  # type: ignore[index]


@pytest.mark.parametrize(
    ("device_map", "error", "match"),
    [
        (["cpu"], TypeError, r"device_map=\['cpu'\] has type list: use a dict"),
        ({0: "cpu"}, TypeError, r"device_map has the key 0 of type int: use module names"),
        ({"a": "gpu"}, ValueError, r"device_map\['a'\]='gpu' is not a device: use an int"),
        ({"a": -1}, ValueError, r"device_map\['a'\]=-1 is a negative device index"),
        ({"a": True}, ValueError, r"device_map\['a'\]=True is not a device"),
        ({"a": "cuda:99"}, ValueError, r"device_map\['a'\] is cuda:99, but this machine has"),
    ],
)
def test_bad_maps_are_refused_with_parse_device_map_errors(
    device_map: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        DevicePlan.from_device_map(device_map)


def test_a_module_placed_twice_is_refused_given_the_model() -> None:
    device_map = {"b": "cpu", "b.0": "disk"}
    DevicePlan.from_device_map(device_map)  # without the model the nesting is unknown
    with pytest.raises(ValueError, match=r"places 'b.0' on 'disk' and the module holding it"):
        DevicePlan.from_device_map(device_map, Net())


# -- the walks parse the map once ---------------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


X = torch.randn(3, 4)


@pytest.fixture
def trained() -> Net:
    torch.manual_seed(0)
    return Net()


@pytest.fixture
def checkpoint(trained: Net, tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    save_file(trained.state_dict(), str(path), metadata={"format": "pt"})
    return path


def _empty() -> Net:
    with init_empty_weights():
        return Net()


def _counting(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[object]:
    """Replace ``module.name`` by a wrapper that records each call."""
    calls: list[object] = []
    real: Callable[..., Any] = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[0] if args else None)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize(
    "device_map", [{"a": "cpu", "b": "disk"}, {"": "cpu"}, "auto", "sequential"], ids=str
)
def test_load_checkpoint_and_dispatch_parses_the_map_once(
    monkeypatch: pytest.MonkeyPatch,
    trained: Net,
    checkpoint: Path,
    device_map: Any,
) -> None:
    parses = _counting(monkeypatch, device_plan_module, "parse_device_map")
    hook_parses = _counting(monkeypatch, align_module, "parse_execution_device")
    model = load_checkpoint_and_dispatch(
        _empty(), checkpoint, device_map, max_memory={"cpu": 200}, force_hooks=True
    )
    assert len(parses) == 1  # from the door to the weights and the hooks
    assert hook_parses == []  # every hook got its device already parsed
    hook = find_align_devices_hook(model)
    assert hook is not None and hook.execution_device == "cpu" and hook.target_device == CPU
    assert torch.equal(model(X), trained(X))


def test_dispatch_model_and_load_checkpoint_in_model_parse_the_map_once(
    monkeypatch: pytest.MonkeyPatch, trained: Net, checkpoint: Path, tmp_path: Path
) -> None:
    parses = _counting(monkeypatch, device_plan_module, "parse_device_map")
    hook_parses = _counting(monkeypatch, align_module, "parse_execution_device")
    model = _empty()
    load_checkpoint_in_model(model, checkpoint, device_map={"a": "cpu", "b": "cpu"})
    assert len(parses) == 1
    dispatch_model(model, {"a": "cpu", "b": "disk"}, offload_dir=tmp_path / "offload")
    assert len(parses) == 2 and hook_parses == []
    assert torch.equal(model(X), trained(X))


@pytest.mark.parametrize("device_map", ["auto", {"": "disk"}], ids=str)
def test_load_pretrained_parses_the_map_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, device_map: Any
) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=16)
    reference = transformers.GPT2LMHeadModel(config).eval()
    reference.save_pretrained(tmp_path / "gpt2")
    parses = _counting(monkeypatch, device_plan_module, "parse_device_map")
    hook_parses = _counting(monkeypatch, align_module, "parse_execution_device")
    model = accel_bigmodel.load_pretrained(
        tmp_path / "gpt2", device_map=device_map, max_memory={"cpu": 20_000}
    )
    assert len(parses) == 1 and hook_parses == []
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(model(ids).logits, reference(ids).logits)


def test_hooks_given_an_execution_device_do_not_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    hook_parses = _counting(monkeypatch, align_module, "parse_execution_device")
    hook = AlignDevicesHook(execution_device=ExecutionDevice(0, CPU))
    assert hook_parses == []
    assert hook.execution_device == 0 and hook.target_device == CPU
    assert hook.execution == ExecutionDevice(0, CPU)
    add_hook_to_module(nn.Linear(2, 2), AlignDevicesHook(execution_device="cpu"))
    assert hook_parses == ["cpu"]  # a device as written is still parsed, by its hook


def test_only_the_device_plan_parses_device_maps() -> None:
    """No module but ``device_plan`` calls ``parse_device_map`` (``device_map`` defines it and
    ``check_device_map`` validates with it): a new call elsewhere would be a second parse."""
    source = Path(accel_bigmodel.__file__).parent
    callers = set()
    for path in source.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "parse_device_map":
                callers.add(path.relative_to(source).as_posix())
    assert callers == {"device_map.py", "device_plan.py"}
