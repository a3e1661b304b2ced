"""Fuzz test of the big-model inputs users write: device maps, budgets, offload folders, files.

Every case is generated from a fixed seed and ends in one of two ways: success, where the input
is really valid (the model then computes what the reference model computes), or a clear error:
an exception of one of the types the package documents (never a raw ``KeyError``,
``IndexError``, ``AttributeError``, ``JSONDecodeError`` ...), whose message names the argument
or the file and matches what the case expects. After a failed call the model is exactly as it
was (values, devices, meta stays meta, ties, no hooks, no registered offload entries) and the
offload folder holds the same files with the same sizes as before.

Each test prints how many cases it tried and the running total.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import struct
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from accel_bigmodel import (
    disk_offload,
    dispatch_model,
    get_balanced_memory,
    infer_auto_device_map,
    init_empty_weights,
    load_checkpoint_and_dispatch,
    load_checkpoint_in_model,
    load_offloaded_weights,
    offload_state_dict,
    set_module_tensor_to_device,
)
from accel_bigmodel.device_map import check_device_map
from accel_bigmodel.loading.plan import MissingWeightsError
from accel_bigmodel.offload import registered_offload_index
from accel_state.safetensors_header import SafetensorsHeaderError

pytestmark = pytest.mark.usefixtures("one_thread")

SEED = 31
IDS = torch.tensor([[1, 2, 3, 7]])

# Every error message says what to do (conventions: "says how to fix it").
SAYS_A_FIX = re.compile(
    r"\b(use|pass|add|remove|give|put|load|offload|regenerate|download|save|re-save|convert|"
    r"check|delete|allow|fix)\b",
    re.IGNORECASE,
)

# The exact exception types a bad input may raise (exact: a JSONDecodeError or a
# UnicodeDecodeError is a ValueError subclass, but a raw one from deep inside is not clear).
CLEAR_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    TypeError,
    FileNotFoundError,
    SafetensorsHeaderError,
    MissingWeightsError,
    RuntimeError,  # strict=True key mismatches (Accelerate's type)
)


# -- the model --------------------------------------------------------------------------------


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.relu(self.inner(x)))


class Net(nn.Module):
    """Nested Linear layers, a tied embedding/head and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((4,), 1.5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden * self.scale)


def real_model() -> Net:
    torch.manual_seed(0)
    return Net().eval()


def empty_model() -> Net:
    with init_empty_weights():
        model = Net().eval()
    model.head.weight = model.embed.weight
    return model


MODULES = ["embed", "blocks", "blocks.0", "blocks.0.inner", "blocks.0.inner.fc", "blocks.0.proj"]
MODULES += [name.replace("blocks.0", "blocks.1") for name in MODULES[2:]] + ["head"]
DISK_BLOCK = {"embed": "cpu", "blocks.0": "cpu", "blocks.1": "disk", "head": "cpu", "scale": "cpu"}


# -- snapshots: "the model is unchanged", "the folder is unchanged" ---------------------------


def snapshot(model: nn.Module) -> dict[str, Any]:
    tensors: dict[str, Any] = {}
    for name, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        data = None if tensor.is_meta else tensor.detach().clone()
        tensors[name] = (tensor.device.type, tensor.dtype, tuple(tensor.shape), data)
    return {
        "tensors": tensors,
        "tied": [id(model.get_parameter("head.weight")) == id(model.get_parameter("embed.weight"))],
        "hooks": [name for name, module in model.named_modules() if hasattr(module, "_hf_hook")],
        "moved": "hf_device_map" in model.__dict__ or "to" in model.__dict__,
        "registry": registered_offload_index(model),
    }


def same_snapshot(before: dict[str, Any], after: dict[str, Any]) -> str | None:
    """A description of the first difference, or None."""
    for key in ("tied", "hooks", "moved", "registry"):
        if before[key] != after[key]:
            return f"{key} changed: {before[key]!r} -> {after[key]!r}"
    if before["tensors"].keys() != after["tensors"].keys():
        return "the model's tensor names changed"
    for name, (device, dtype, shape, data) in before["tensors"].items():
        now = after["tensors"][name]
        if (device, dtype, shape) != now[:3]:
            return f"{name!r} changed from {(device, dtype, shape)} to {now[:3]}"
        if data is not None and not torch.equal(data, now[3]):
            return f"the value of {name!r} changed"
    return None


def listing(folder: Path | None) -> dict[str, int] | None:
    if folder is None or not folder.exists():
        return None
    return {
        str(path.relative_to(folder)): path.stat().st_size
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


# -- cases ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fails:
    """The call must raise ``kind`` with a message matching ``pattern`` (``re.search``)."""

    kind: type[BaseException] | tuple[type[BaseException], ...]
    pattern: str


@dataclass(frozen=True)
class Works:
    """The call must succeed; ``check(model, result)`` then verifies what it did."""

    check: Callable[[nn.Module, Any], None]


@dataclass(frozen=True)
class Either:
    """A randomly damaged input that may still be valid: success checked by ``check``, or an
    error matching ``pattern``."""

    check: Callable[[nn.Module, Any], None]
    pattern: str


Expect = Fails | Works | Either


@dataclass
class Fuzz:
    """Runs cases and collects what went wrong (all of it, not only the first failure)."""

    problems: list[str] = field(default_factory=list)
    tried: int = 0

    def case(
        self,
        label: str,
        model: nn.Module,
        call: Callable[[], Any],
        expect: Expect,
        folders: tuple[Path | None, ...] = (),
    ) -> None:
        self.tried += 1
        before = snapshot(model)
        listed = [listing(folder) for folder in folders]
        error: BaseException | None = None
        result: Any = None
        with warnings.catch_warnings():
            # Keys naming nothing and split tied weights warn by design; not what is judged here.
            warnings.simplefilter("ignore")
            try:
                result = call()
            except Exception as raised:  # noqa: BLE001 - every outcome is judged below
                error = raised
            if error is None:
                self._succeeded(label, model, result, expect)
                return
        self._failed(label, error, expect)
        changed = same_snapshot(before, snapshot(model))
        if changed is not None:
            self.problems.append(f"{label}: failed call changed the model: {changed}")
        for folder, was in zip(folders, listed, strict=True):
            if listing(folder) != was:
                self.problems.append(
                    f"{label}: failed call changed {folder}: {was} -> {listing(folder)}"
                )

    def _succeeded(self, label: str, model: nn.Module, result: Any, expect: Expect) -> None:
        if isinstance(expect, Fails):
            self.problems.append(
                f"{label}: accepted an invalid input (expected {expect.kind} ~ {expect.pattern!r})"
            )
            return
        try:
            expect.check(model, result)
        except Exception as wrong:  # noqa: BLE001 - reported with the case
            self.problems.append(f"{label}: succeeded but wrongly: {type(wrong).__name__}: {wrong}")

    def _failed(self, label: str, error: BaseException, expect: Expect) -> None:
        message = f"{type(error).__name__}: {error}"
        if type(error) not in CLEAR_ERRORS:
            self.problems.append(f"{label}: unclear error type {message}")
            return
        if isinstance(expect, Works):
            self.problems.append(f"{label}: refused a valid input: {message}")
        elif isinstance(expect, Fails) and not isinstance(error, expect.kind):
            self.problems.append(f"{label}: expected {expect.kind}, got {message}")
        elif not re.search(expect.pattern, str(error)):
            self.problems.append(f"{label}: message does not match {expect.pattern!r}: {message}")
        if not SAYS_A_FIX.search(str(error)):
            self.problems.append(f"{label}: the message says no fix: {message}")

    def report(self, capsys: pytest.CaptureFixture[str], category: str) -> None:
        _TOTAL[category] = self.tried
        with capsys.disabled():
            print(
                f"\ninput fuzz: {self.tried} {category} cases; "
                f"{sum(_TOTAL.values())} cases tried so far in this run"
            )
            for problem in self.problems:
                print(f"  BAD: {problem}")
        assert not self.problems, f"{len(self.problems)} bad outcomes:\n" + "\n".join(
            self.problems[:40]
        )


_TOTAL: dict[str, int] = {}


# -- what a success must look like ------------------------------------------------------------


def reference() -> torch.Tensor:
    with torch.no_grad():
        return real_model()(IDS)


def computes_the_reference(model: nn.Module, _result: Any = None) -> None:
    # A model on one device has no hooks to move its inputs (a plain .to(device), as Accelerate).
    first = model.get_parameter("embed.weight")
    hooked = hasattr(model, "_hf_hook") or first.is_meta
    with torch.no_grad():
        out = model(IDS if hooked else IDS.to(first.device))
    assert torch.allclose(out.cpu(), reference(), atol=1e-6), "outputs differ from the reference"


def loaded_then_dispatched(
    device_map: Any, folder: Path | None
) -> Callable[[nn.Module, Any], None]:
    """After load_checkpoint_in_model: dispatch with the same map and compare outputs."""

    def check(model: nn.Module, _result: Any) -> None:
        meta_places = [key for key, value in device_map.items() if str(value) == "meta"]
        if meta_places:  # "meta" entries are dropped by design (transformers' device_map="meta")
            for name, tensor in model.state_dict(keep_vars=True).items():
                if any(name == key or name.startswith(key + ".") for key in meta_places):
                    assert tensor.is_meta, f"{name} should stay on meta"
            return
        dispatch_model(model, device_map, offload_dir=folder, prefetch_depth=0)
        computes_the_reference(model)

    return check


def plans_a_covering_map(model: nn.Module, result: Any) -> None:
    check_device_map(model, result)


def returns_a_budget(_model: nn.Module, result: Any) -> None:
    assert isinstance(result, dict) and all(value >= 0 for value in result.values()), result


# -- fixtures ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Files:
    root: Path
    safetensors: Path
    bin: Path
    disk_block: Path  # an offload folder holding blocks.1 (written by load_checkpoint_in_model)
    whole: Path  # an offload folder holding every weight (written by offload_state_dict)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    root = tmp_path_factory.mktemp("fuzz")
    state = {name: tensor.clone() for name, tensor in real_model().state_dict().items()}
    safetensors = root / "model.safetensors"
    save_file({k: v for k, v in state.items() if k != "head.weight"}, safetensors, {"format": "pt"})
    (root / "bin").mkdir()
    binary = root / "bin" / "pytorch_model.bin"
    torch.save(state, binary)
    disk_block = root / "disk_block"
    load_checkpoint_in_model(
        empty_model(), binary, device_map=DISK_BLOCK, offload_folder=disk_block
    )
    whole = root / "whole"
    offload_state_dict(whole, real_model().state_dict())
    return Files(root, safetensors, binary, disk_block, whole)


class Scratch:
    """Fresh paths under one folder, one per case."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.count = 0

    def path(self, stem: str = "case") -> Path:
        self.count += 1
        return self.root / f"{stem}{self.count}"

    def copy(self, folder: Path) -> Path:
        target = self.path(folder.name)
        shutil.copytree(folder, target)
        return target


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Scratch]:
    yield Scratch(tmp_path)


def accelerators_absent() -> list[Any]:
    """Device values naming accelerators this machine does not have."""
    count = torch.cuda.device_count()
    absent: list[Any] = [count, f"cuda:{count}", torch.device("cuda", count)]
    if not torch.backends.mps.is_available():
        absent.append("mps")
    if not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        absent.append("xpu:0")
    return absent


# -- device_map -------------------------------------------------------------------------------

NOT_DEVICES: list[Any] = ["gpu", "cuda:x", -1, 1.5, None, True, "CPU", " cpu", "disk:0", [0], "0"]
VALID_DEVICES: list[Any] = ["cpu", "disk", torch.device("cpu"), "cpu:0"]


def random_partition(rng: random.Random) -> dict[str, Any]:
    """A valid map: a random cut of the module tree, each piece on a random valid device."""

    def cut(name: str, children: list[str]) -> list[str]:
        if not children or rng.random() < 0.4:
            return [name]
        pieces: list[str] = []
        for child in children:
            pieces.extend(cut(child, _children(child)))
        return pieces

    pieces = cut("", ["embed", "blocks", "head", "scale"])
    return {piece: rng.choice(VALID_DEVICES) for piece in pieces}


def _children(name: str) -> list[str]:
    if name == "blocks":
        return ["blocks.0", "blocks.1"]
    if name.startswith("blocks.") and name.count(".") == 1:
        return [f"{name}.inner", f"{name}.proj"]
    if name.endswith(".inner"):
        return [f"{name}.fc"]
    return []


def damaged_map(rng: random.Random, kind: str) -> tuple[Any, Fails | None]:
    """A random map with one fault of ``kind``, and what the entry points must answer."""
    device_map = random_partition(rng)
    keys = list(device_map)
    key = rng.choice(keys)
    if kind == "not a device":
        value = rng.choice(NOT_DEVICES)
        device_map[key] = value
        return device_map, Fails(ValueError, re.escape(f"device_map[{key!r}]={value!r}") + " is")
    if kind == "absent accelerator":
        device_map[key] = rng.choice(accelerators_absent())
        return device_map, Fails(ValueError, re.escape(f"device_map[{key!r}] is ") + ".*machine")
    if kind == "unmapped":
        covered = [k for k in keys if k not in ("", "scale")]
        if not covered:
            device_map = {"embed": "cpu", "blocks": "cpu", "head": "cpu"}
            covered = ["blocks"]
        del device_map[rng.choice(covered)]
        return device_map, Fails(ValueError, UNMAPPED)
    if kind == "placed twice":
        parent = rng.choice([k for k in ["", "blocks", "blocks.0", "blocks.1"] if k not in keys])
        inside = [k for k in keys if parent == "" or k.startswith(parent + ".")]
        if not inside:
            return damaged_map(rng, kind)
        child = rng.choice(inside)
        device_map[parent] = "cpu" if str(device_map[child]) == "disk" else "disk"
        return device_map, Fails(ValueError, r"places .* and the module holding it")
    if kind == "key not a string":
        device_map[rng.choice([1, None, 2.5, ("blocks",)])] = "cpu"
        return device_map, Fails(TypeError, r"device_map has the key")
    if kind == "unknown key":
        device_map[rng.choice(["nope", "blocks.7", "embed.bias", "blocks.0.fc"])] = "cpu"
        return device_map, None
    if kind == "same device nested":
        parent = rng.choice(["", "blocks"])
        inside = [k for k in keys if parent == "" or k.startswith(parent + ".")]
        if not inside or parent in keys:
            return device_map, None
        devices = {str(device_map[k]) for k in inside}
        if len(devices) == 1 and devices <= {"cpu", "cpu:0", "disk"}:
            device_map[parent] = device_map[inside[0]]
            return device_map, None
        return damaged_map(rng, "same device nested")
    return device_map, None  # "valid"


MAP_FAULTS = [
    "valid",
    "not a device",
    "absent accelerator",
    "unmapped",
    "placed twice",
    "key not a string",
    "unknown key",
    "same device nested",
]


def device_map_targets(
    files: Files, scratch: Scratch, device_map: Any, expect: Fails | None, label: str
) -> Iterator[tuple[str, nn.Module, Callable[[], Any], Expect, tuple[Path | None, ...]]]:
    """The four entry points that take a device map, with what each must answer."""
    folder = scratch.path("offload")
    yield (
        f"{label} load_checkpoint_in_model(safetensors)",
        (model := empty_model()),
        lambda: load_checkpoint_in_model(model, files.safetensors, device_map=device_map),
        expect or Works(loaded_then_dispatched(device_map, None)),
        (),
    )
    yield (
        f"{label} load_checkpoint_in_model(bin, offload_folder)",
        (model2 := empty_model()),
        lambda: load_checkpoint_in_model(
            model2, files.bin, device_map=device_map, offload_folder=folder
        ),
        expect or Works(loaded_then_dispatched(device_map, folder)),
        (folder,),
    )
    folder3 = scratch.path("offload")
    yield (
        f"{label} dispatch_model(in-memory model)",
        (model3 := real_model()),
        lambda: dispatch_model(model3, device_map, offload_dir=folder3, prefetch_depth=0),
        expect or Works(lambda m, _r: computes_or_meta(m, device_map)),
        (folder3,),
    )
    devices = {str(value) for value in device_map.values()} if isinstance(device_map, dict) else ()
    if expect is None and "meta" in devices and len(devices) > 1:
        # Loaded blocks beside weightless ones could not be dispatched: refused before loading.
        expect = Fails(ValueError, r"='meta': weights placed on the meta device get no data")
    yield (
        f"{label} load_checkpoint_and_dispatch(safetensors)",
        (model4 := empty_model()),
        lambda: load_checkpoint_and_dispatch(
            model4, files.safetensors, device_map=device_map, prefetch_depth=0
        ),
        expect or Works(lambda m, _r: computes_or_meta(m, device_map)),
        (),
    )


def computes_or_meta(model: nn.Module, device_map: Any) -> None:
    if any(str(value) == "meta" for value in device_map.values()):
        return  # weights placed on meta are dropped by design; nothing to compute
    computes_the_reference(model)


def not_a_map(kind: str, value: Any) -> str:
    """The message names the argument, the type and the value, in either order."""
    return rf"(?=.*device_map)(?=.*has type {kind})(?=.*{re.escape(repr(value))})"


UNMAPPED = r"does not (place|give any device)|places no module holding"

EXPLICIT_MAPS: list[tuple[str, Any, Fails | None]] = [
    ("a list", [("", "cpu")], Fails(TypeError, not_a_map("list", [("", "cpu")]))),
    ("a number", 3, Fails(TypeError, not_a_map("int", 3))),
    ("a set", {"cpu"}, Fails(TypeError, not_a_map("set", {"cpu"}))),
    ("keys not modules", {"nope": "cpu", "other": "disk"}, Fails(ValueError, UNMAPPED)),
    ("unknown key with a root", {"": "cpu", "nope": "cpu"}, None),
    (
        "parent and child on different devices",
        {"embed": "cpu", "blocks": "cpu", "blocks.0": "disk", "head": "cpu", "scale": "cpu"},
        Fails(ValueError, r"places 'blocks.0' on 'disk' and the module holding it, 'blocks'"),
    ),
    (
        "root and a tensor on different devices",
        {"": "cpu", "blocks.1.proj.weight": "disk"},
        Fails(ValueError, r"places 'blocks.1.proj.weight' on 'disk' .* '', on 'cpu'"),
    ),
    ("parent and child on one device", {"": "disk", "blocks.0": "disk"}, None),
    (
        "a module missing",
        {"blocks": "cpu", "head": "cpu", "scale": "cpu"},
        Fails(ValueError, r"embed\.weight"),
    ),
    ("empty", {}, Fails(ValueError, UNMAPPED)),
    ("disk everywhere", {"": "disk"}, None),
    ("meta everywhere", {"": "meta"}, None),
    ("meta for one block", {"embed": "cpu", "blocks": "meta", "head": "cpu", "scale": "cpu"}, None),
    *[
        (
            f"device {value!r}",
            {"": value},
            Fails(ValueError, re.escape(f"device_map['']={value!r}")),
        )
        for value in NOT_DEVICES
    ],
    *[
        (f"absent {value!r}", {"": value}, Fails(ValueError, r"device_map\[''\] is .*machine"))
        for value in accelerators_absent()
    ],
]


def test_device_map_fuzz(
    files: Files, scratch: Scratch, capsys: pytest.CaptureFixture[str]
) -> None:
    fuzz = Fuzz()
    cases: list[tuple[str, Any, Fails | None]] = list(EXPLICIT_MAPS)
    rng = random.Random(SEED)
    for number in range(112):
        kind = MAP_FAULTS[number % len(MAP_FAULTS)]
        device_map, expect = damaged_map(rng, kind)
        cases.append((f"random #{number} ({kind}) {device_map!r}", device_map, expect))
    for label, device_map, expect in cases:
        for target in device_map_targets(files, scratch, device_map, expect, label):
            fuzz.case(*target)

    # "disk" without an offload folder: fine for safetensors (read in place), refused when the
    # weights must be written (a .bin checkpoint, or a model held in memory).
    on_disk = dict(DISK_BLOCK)
    model = empty_model()
    fuzz.case(
        "disk without folder: load_checkpoint_in_model(safetensors)",
        model,
        lambda: load_checkpoint_in_model(model, files.safetensors, device_map=on_disk),
        Works(loaded_then_dispatched(on_disk, None)),
    )
    model = empty_model()
    fuzz.case(
        "disk without folder: load_checkpoint_in_model(bin)",
        model,
        lambda: load_checkpoint_in_model(model, files.bin, device_map=on_disk),
        Fails(ValueError, r"offload_folder=None.*Pass offload_folder="),
    )
    model = real_model()
    fuzz.case(
        "disk without folder: dispatch_model",
        model,
        lambda: dispatch_model(model, on_disk),
        Fails(ValueError, r"needs an offload_dir.*Pass offload_dir="),
    )
    model = empty_model()
    fuzz.case(
        "disk without folder: load_checkpoint_and_dispatch(bin)",
        model,
        lambda: load_checkpoint_and_dispatch(model, files.bin, device_map=on_disk),
        Fails(ValueError, r"offload_folder=None"),
    )
    not_a_folder = files.root / "model.safetensors"
    for label, target in [
        ("load_checkpoint_in_model", "load"),
        ("dispatch_model", "dispatch"),
    ]:
        model = empty_model() if target == "load" else real_model()

        def call(model: nn.Module = model, target: str = target) -> Any:
            if target == "load":
                return load_checkpoint_in_model(
                    model, files.bin, device_map=on_disk, offload_folder=not_a_folder
                )
            return dispatch_model(model, on_disk, offload_dir=not_a_folder)

        fuzz.case(
            f"offload folder is a file: {label}",
            model,
            call,
            Fails(ValueError, r"offload_(folder|dir)=.*is a file, not a folder"),
        )
    for strategy in ("fastest", "AUTO", ""):
        model = empty_model()
        fuzz.case(
            f"device_map={strategy!r}",
            model,
            lambda model=model, strategy=strategy: load_checkpoint_and_dispatch(
                model, files.safetensors, device_map=strategy
            ),
            Fails(ValueError, r"is not a placement strategy: use one of 'auto'"),
        )
    fuzz.report(capsys, "device_map")


# -- max_memory -------------------------------------------------------------------------------

# (value, problem): problem is None for a valid value, else (type, message fragment).
BUDGET_VALUES: list[tuple[Any, tuple[type[Exception], str] | None]] = [
    (0, None),
    (10, None),
    (10**9, None),
    (1.5, None),
    (1.5e9, None),
    (float("inf"), None),
    (10**30, None),
    ("1GB", None),
    ("1.5GB", None),
    ("100KiB", None),
    ("2MiB", None),
    ("8Gb", None),
    (" 1GB", None),
    ("1e3MB", None),
    (-1, (ValueError, "is not a size")),
    (-5.0, (ValueError, "is not a size")),
    (float("nan"), (ValueError, "is not a size")),
    ("10XB", (ValueError, "is not a valid size")),
    ("abc", (ValueError, "is not a valid size")),
    ("", (ValueError, "is not a valid size")),
    ("-1GB", (ValueError, "is not a valid size")),
    ("nanGB", (ValueError, "is not a valid size")),
    ("100", (ValueError, "is not a valid size")),
    (None, (TypeError, "has type NoneType")),
    (True, (TypeError, "has type bool")),
    ([1], (TypeError, "has type list")),
]


def budget_keys() -> list[tuple[Any, str | None, bool]]:
    """(key, problem for any use, whether this machine has it): problem None = a device key."""
    count = torch.cuda.device_count()
    return [
        ("cpu", None, True),
        ("disk", None, True),
        (0, None, count > 0),
        (count, None, False),
        (99, None, False),
        ("mps", None, torch.backends.mps.is_available()),
        ("gpu0", "is not a device the planner knows", True),
        ("cuda:0", "is not a device the planner knows", True),
        (torch.device("cpu"), "is not a device the planner knows", True),
        (None, "is not a device the planner knows", True),
        (-1, "a negative accelerator index", True),
    ]


def budget_expectation(budget: dict[Any, Any], loads: bool) -> Fails | None:
    """What get_max_memory (and, when ``loads``, the loading strategies) must answer."""
    keys = {repr(key): (problem, here) for key, problem, here in budget_keys()}
    values = {repr(value): problem for value, problem in BUDGET_VALUES}
    for key, value in budget.items():
        problem, _ = keys[repr(key)]
        if problem is not None:
            return Fails(ValueError, re.escape(f"max_memory has the key {key!r}") + ".*" + problem)
        value_problem = values[repr(value)]
        if value_problem is not None:
            kind, fragment = value_problem
            return Fails(kind, re.escape(f"max_memory[{key!r}]") + ".*" + re.escape(fragment))
    if loads:
        for key in budget:
            _, here = keys[repr(key)]
            if not here:
                return Fails(ValueError, re.escape(f"max_memory[{key!r}] is ") + ".*machine")
    return None


def test_max_memory_fuzz(files: Files, capsys: pytest.CaptureFixture[str]) -> None:
    fuzz = Fuzz()
    keys = budget_keys()
    rng = random.Random(SEED + 1)
    budgets: list[Any] = []
    for key, _, _ in keys:  # each key alone, with a valid value
        budgets.append({key: "1GB"})
    for value, _ in BUDGET_VALUES:  # each value alone, on the CPU
        budgets.append({"cpu": value})
    for _ in range(96):
        chosen = rng.sample(keys, rng.randint(1, 3))
        budgets.append({key: rng.choice(BUDGET_VALUES)[0] for key, _, _ in chosen})
    not_dicts: list[tuple[Any, str]] = [
        (["cpu"], "has type list"),
        ("10GB", "has type str"),
        (5, "has type int"),
        ((("cpu", "1GB"),), "has type tuple"),
    ]
    for budget, fragment in not_dicts:
        expect = Fails(TypeError, re.escape(f"max_memory={budget!r} ") + fragment)
        model = empty_model()
        fuzz.case(
            f"infer_auto_device_map(max_memory={budget!r})",
            model,
            lambda model=model, budget=budget: infer_auto_device_map(model, max_memory=budget),
            expect,
        )
        model = empty_model()
        fuzz.case(
            f"load_checkpoint_and_dispatch('auto', max_memory={budget!r})",
            model,
            lambda model=model, budget=budget: load_checkpoint_and_dispatch(
                model, files.safetensors, device_map="auto", max_memory=budget
            ),
            expect,
        )
    strategies = ["auto", "balanced", "balanced_low_0", "sequential"]
    for number, budget in enumerate(budgets):
        label = f"#{number} max_memory={budget!r}"
        planned = budget_expectation(budget, loads=False)
        model = empty_model()
        fuzz.case(
            f"{label} infer_auto_device_map",
            model,
            lambda model=model, budget=budget: infer_auto_device_map(
                model, max_memory=dict(budget)
            ),
            planned or Works(plans_a_covering_map),
        )
        model = empty_model()
        fuzz.case(
            f"{label} get_balanced_memory",
            model,
            lambda model=model, budget=budget: get_balanced_memory(model, dict(budget)),
            planned or Works(returns_a_budget),
        )
        strategy = strategies[number % len(strategies)]
        model = empty_model()
        fuzz.case(
            f"{label} load_checkpoint_and_dispatch({strategy!r})",
            model,
            lambda model=model, budget=budget, strategy=strategy: load_checkpoint_and_dispatch(
                model,
                files.safetensors,
                device_map=strategy,
                max_memory=dict(budget),
                prefetch_depth=0,
            ),
            budget_expectation(budget, loads=True) or Works(computes_the_reference),
        )
    fuzz.report(capsys, "max_memory")


# -- offload folders and indexes --------------------------------------------------------------


def partly_offloaded() -> Net:
    """The in-memory model with blocks.1 on meta, as loading with DISK_BLOCK leaves it."""
    model = real_model()
    for name, _ in list(model.named_parameters()):
        if name.startswith("blocks.1."):
            set_module_tensor_to_device(model, name, "meta")
    return model


Mutation = Callable[[Path], None]


def write_index(content: bytes | Any) -> Mutation:
    def mutate(folder: Path) -> None:
        data = content if isinstance(content, bytes) else json.dumps(content).encode()
        (folder / "index.json").write_bytes(data)

    return mutate


def edit_index(edit: Callable[[dict[str, Any]], None]) -> Mutation:
    def mutate(folder: Path) -> None:
        index = json.loads((folder / "index.json").read_text())
        edit(index)
        (folder / "index.json").write_text(json.dumps(index, indent=2))

    return mutate


def edit_file(name: str, change: Callable[[bytes], bytes | None]) -> Mutation:
    def mutate(folder: Path) -> None:
        path = folder / name
        new = change(path.read_bytes())
        if new is None:
            path.unlink()
        else:
            path.write_bytes(new)

    return mutate


WEIGHT = "blocks.1.proj.weight"  # float32 [4, 4]: 64 bytes
WHOLE_WEIGHT = "blocks.0.inner.fc.weight"


def set_entry(weight: str, **values: Any) -> Mutation:
    return edit_index(lambda index: index[weight].update(values))


def pop_key(weight: str, key: str) -> Mutation:
    return edit_index(lambda index: index[weight].pop(key))


@dataclass(frozen=True)
class IndexCase:
    """One damage to an offload folder, and what each entry point must answer.

    ``dispatch`` is the answer of dispatch_model (and disk_offload); ``load`` the one of
    load_offloaded_weights (``None``: same as ``dispatch``; ``"skip"``: the index is not JSON,
    so a user could not pass it).
    """

    label: str
    mutate: Mutation
    dispatch: Fails | Either | None
    load: Fails | None | str = None


NOT_JSON = Fails(ValueError, r"offload index .*index\.json is not valid JSON.*regenerate")
STALE = r"offloaded weight file .*\.dat has \d+ bytes but its index entry .* needs \d+"


def index_cases(weight: str, raw: bytes, rng: random.Random) -> list[IndexCase]:
    """The damages to an offload folder whose entry ``weight`` is float32 [4, 4]."""
    name = re.escape(weight)
    cases = [IndexCase("unchanged", lambda folder: None, None)]
    offsets = {0, 1, 10, len(raw) // 2, len(raw) - 1, *rng.sample(range(len(raw)), 6)}
    for offset in sorted(offsets):
        cut = write_index(raw[:offset])
        cases.append(IndexCase(f"index.json cut at {offset}", cut, NOT_JSON, "skip"))
    for number in range(6):
        garbled = bytearray(raw)
        for position in rng.sample(range(len(raw)), 3):
            garbled[position] = rng.choice(b'\xff\x00{}[]":,')
        # A garbled byte may leave valid JSON (a comma for a comma): success is then checked.
        maybe = Either(computes_the_reference, r"offload index|index\.json|offload_index")
        cases.append(
            IndexCase(f"index.json garbled #{number}", write_index(bytes(garbled)), maybe, "skip")
        )
    not_dict = Fails(ValueError, r"index\.json holds a JSON \w+, not an object")
    not_dict_load = Fails(TypeError, r"index=.* has type \w+: pass the offload index")
    for content in ([1, 2], "weights", 7):
        cases.append(
            IndexCase(f"index.json is {content!r}", write_index(content), not_dict, not_dict_load)
        )
    # index=None is "nothing to load" for load_offloaded_weights (and offload_index=None means
    # "read the folder's index.json", which is null: refused).
    cases.append(IndexCase("index.json is null", write_index(None), not_dict, None))

    def bad_dtype(shown: str) -> Fails:
        return Fails(ValueError, rf"entry '{name}' has dtype {shown}, which is not a torch dtype")

    def bad_shape(shown: str) -> Fails:
        return Fails(ValueError, rf"entry '{name}' has shape {shown}: a shape is a list")

    stale = Fails(ValueError, STALE)
    cases += [
        IndexCase(
            "entry not an object",
            edit_index(lambda index: index.__setitem__(weight, [1])),
            Fails(ValueError, rf"entry '{name}' is \[1\], not an object"),
            Fails(ValueError, r"is \[1\], not a mapping"),
        ),
        IndexCase("entry without dtype", pop_key(weight, "dtype"), bad_dtype("None")),
        IndexCase("entry without shape", pop_key(weight, "shape"), bad_shape("None")),
        IndexCase("unknown dtype", set_entry(weight, dtype="float99"), bad_dtype("'float99'")),
        IndexCase(
            "dtype 'torch.float32'",
            set_entry(weight, dtype="torch.float32"),
            bad_dtype("'torch.float32'"),
        ),
        IndexCase("dtype float16 (file: float32)", set_entry(weight, dtype="float16"), stale),
        IndexCase("dtype float64 (file: float32)", set_entry(weight, dtype="float64"), stale),
        IndexCase(
            "dtype int32 (same size)",
            set_entry(weight, dtype="int32"),
            Fails(ValueError, r"holds torch\.int32 values but the model's .* is torch\.float32"),
        ),
        IndexCase("shape [2, 2]", set_entry(weight, shape=[2, 2]), stale),
        IndexCase("shape [8, 8]", set_entry(weight, shape=[8, 8]), stale),
        IndexCase(
            "shape [16] (same size)",
            set_entry(weight, shape=[16]),
            Fails(ValueError, rf"has shape \[16\] but the model's '{name}' has shape \[4, 4\]"),
        ),
        IndexCase("shape [-4, -4]", set_entry(weight, shape=[-4, -4]), bad_shape(r"\[-4, -4\]")),
        IndexCase("shape '4x4'", set_entry(weight, shape="4x4"), bad_shape("'4x4'")),
        IndexCase(
            "a weight the model lacks",
            edit_index(
                lambda index: index.update({"blocks.9.w": {"dtype": "float32", "shape": [1]}})
            ),
            None,
            Fails(ValueError, r"names 'blocks\.9\.w', which Net has no parameter or buffer"),
        ),
        IndexCase(
            "a weight of the model missing",
            edit_index(lambda index: index.pop(weight)),
            Fails(ValueError, rf"'{name}' are offloaded .* not found"),
            None,
        ),
        IndexCase(
            ".dat missing",
            edit_file(f"{weight}.dat", lambda data: None),
            Fails(FileNotFoundError, rf"{name}\.dat, which does not exist.*Offload the weights"),
        ),
        IndexCase(".dat empty", edit_file(f"{weight}.dat", lambda data: b""), stale),
        IndexCase(
            ".dat a byte longer", edit_file(f"{weight}.dat", lambda data: data + b"0"), stale
        ),
        IndexCase(
            "index.json missing",
            edit_file("index.json", lambda data: None),
            Fails(ValueError, r"not found in offload_index.*or in offload_dir="),
            "skip",
        ),
        IndexCase(
            "entry points to a missing safetensors file",
            set_entry(weight, safetensors_file="gone.safetensors", weight_name=weight),
            Fails(FileNotFoundError, r"gone\.safetensors, which does not exist"),
        ),
        IndexCase(
            "entry points outside the folder",
            set_entry(weight, safetensors_file="../model.safetensors", weight_name=weight),
            Fails(ValueError, r"outside the offload folder"),
            "skip",
        ),
    ]
    for number, length in enumerate(rng.sample(range(1, 64), 5)):
        cut = edit_file(f"{weight}.dat", lambda data, n=length: data[:n])
        cases.append(IndexCase(f".dat cut to {length} bytes #{number}", cut, stale))
    return cases


def index_json_or_skip(folder: Path) -> Any:
    return json.loads((folder / "index.json").read_text())


def loads_listed_weights(index: Any) -> Callable[[nn.Module, Any], None]:
    def check(model: nn.Module, _result: Any) -> None:
        expected = real_model().state_dict()
        for name in index or ():
            tensor = model.get_parameter(name)
            assert tensor.device.type == "cpu" and torch.equal(tensor, expected[name]), name

    return check


def replace_file(path: Path, data: bytes) -> None:
    """Put new bytes at ``path`` without touching the old file (loaded views still map it)."""
    fresh = path.with_suffix(".new")
    fresh.write_bytes(data)
    os.replace(fresh, path)


def in_place_cases(fuzz: Fuzz, files: Files, scratch: Scratch) -> None:
    """Disk weights read in place from the user's safetensors file, which then goes bad."""
    raw = files.safetensors.read_bytes()
    header_end = 8 + struct.unpack("<Q", raw[:8])[0]
    state = {k: v.clone() for k, v in real_model().state_dict().items() if k != "head.weight"}
    without = scratch.path("without") / "model.safetensors"
    without.parent.mkdir()
    save_file({k: v for k, v in state.items() if k != WEIGHT}, without, {"format": "pt"})
    reshaped = scratch.path("reshaped") / "model.safetensors"
    reshaped.parent.mkdir()
    save_file({**state, WEIGHT: torch.zeros(4, 5)}, reshaped, {"format": "pt"})
    garbled = bytearray(raw)
    garbled[header_end // 2] = 0xFF
    changes: list[tuple[str, Callable[[Path], None], Fails | None]] = [
        ("unchanged", lambda path: None, None),
        ("deleted", lambda path: path.unlink(), Fails(FileNotFoundError, "which does not exist")),
        ("truncated", lambda path: replace_file(path, raw[: len(raw) // 2]), Fails(ValueError, "")),
        ("cut in its header", lambda path: replace_file(path, raw[:20]), Fails(ValueError, "")),
        ("header garbled", lambda path: replace_file(path, bytes(garbled)), Fails(ValueError, "")),
        (
            "replaced by a file without the weight",
            lambda path: replace_file(path, without.read_bytes()),
            Fails(ValueError, rf"reads the tensor '{re.escape(WEIGHT)}' of .* does not hold"),
        ),
        (
            "replaced by a file with another shape",
            lambda path: replace_file(path, reshaped.read_bytes()),
            Fails(ValueError, r"says shape \[4, 4\] but .* holds .* with shape \[4, 5\]"),
        ),
    ]
    for label, change, expect in changes:
        checkpoint = scratch.path("in_place") / "model.safetensors"
        checkpoint.parent.mkdir()
        shutil.copyfile(files.safetensors, checkpoint)
        model = empty_model()
        load_checkpoint_in_model(model, checkpoint, device_map=DISK_BLOCK)
        change(checkpoint)
        if expect is not None:  # every message names the file
            named = f"(?=.*{re.escape(str(checkpoint))})(?=.*{expect.pattern})"
            expect = Fails(expect.kind, named)
        fuzz.case(
            f"checkpoint read in place {label}: dispatch_model",
            model,
            lambda model=model: dispatch_model(model, DISK_BLOCK, prefetch_depth=0),
            expect or Works(computes_the_reference),
            (checkpoint.parent,),
        )


def test_offload_index_fuzz(
    files: Files, scratch: Scratch, capsys: pytest.CaptureFixture[str]
) -> None:
    fuzz = Fuzz()
    rng = random.Random(SEED + 2)
    block_raw = (files.disk_block / "index.json").read_bytes()
    whole_raw = (files.whole / "index.json").read_bytes()
    for case in index_cases(WEIGHT, block_raw, rng):
        # dispatch_model of a model whose blocks.1 lives in the folder
        folder = scratch.copy(files.disk_block)
        case.mutate(folder)
        model = partly_offloaded()
        fuzz.case(
            f"{case.label}: dispatch_model(offload_dir)",
            model,
            lambda model=model, folder=folder: dispatch_model(
                model, DISK_BLOCK, offload_dir=folder, prefetch_depth=0
            ),
            case.dispatch or Works(computes_the_reference),
            (folder,),
        )
        if case.load == "skip":
            continue
        # load_offloaded_weights with the index as read from the folder
        folder = scratch.copy(files.disk_block)
        case.mutate(folder)
        index = index_json_or_skip(folder)
        load_expect = case.dispatch if case.load is None else case.load
        if case.label in ("a weight of the model missing", "index.json is null"):
            load_expect = None  # loads what is listed (nothing, for null)
        model = partly_offloaded()
        fuzz.case(
            f"{case.label}: load_offloaded_weights",
            model,
            lambda model=model, folder=folder, index=index: load_offloaded_weights(
                model, index, folder
            ),
            load_expect or Works(loads_listed_weights(index)),
            (folder,),
        )
        # the same index given to dispatch_model as offload_index=
        folder = scratch.copy(files.disk_block)
        case.mutate(folder)
        model = partly_offloaded()
        given = index_json_or_skip(folder)
        if isinstance(given, dict) or given is None:
            expect: Fails | Either | None = case.dispatch
            if case.label == "entry not an object":
                expect = Fails(TypeError, r"offload_index\['blocks\.1\.proj\.weight'\]=\[1\]")
        else:
            expect = Fails(TypeError, r"offload_index=.* has type \w+")
        fuzz.case(
            f"{case.label}: dispatch_model(offload_index=)",
            model,
            lambda model=model, folder=folder, given=given: dispatch_model(
                model, DISK_BLOCK, offload_dir=folder, offload_index=given, prefetch_depth=0
            ),
            expect or Works(computes_the_reference),
            (folder,),
        )
    for case in index_cases(WHOLE_WEIGHT, whole_raw, rng):
        folder = scratch.copy(files.whole)
        case.mutate(folder)
        model = empty_model()
        expect = case.dispatch
        if case.label == "a weight of the model missing":
            expect = Fails(ValueError, rf"{re.escape(WHOLE_WEIGHT)}' are offloaded .* not found")
        fuzz.case(
            f"{case.label}: disk_offload(whole model)",
            model,
            lambda model=model, folder=folder: disk_offload(model, folder, prefetch_depth=0),
            expect or Works(computes_the_reference),
            (folder,),
        )
    in_place_cases(fuzz, files, scratch)
    fuzz.report(capsys, "offload index")


# -- checkpoint files -------------------------------------------------------------------------


def checkpoint_targets(
    path: Path, scratch: Scratch, pattern: str
) -> Iterator[tuple[str, nn.Module, Callable[[], Any], Expect, tuple[Path | None, ...]]]:
    folder = scratch.path("offload")
    for label, device_map in [
        ("no device_map", None),
        ("{'': 'cpu'}", {"": "cpu"}),
        ("blocks.1 on disk", DISK_BLOCK),
    ]:
        model = empty_model()
        yield (
            f"load_checkpoint_in_model({label})",
            model,
            lambda model=model, device_map=device_map: load_checkpoint_in_model(
                model, path, device_map=device_map, offload_folder=folder
            ),
            Fails(CLEAR_ERRORS, pattern),
            (folder,),
        )
    model = empty_model()
    yield (
        "load_checkpoint_and_dispatch('auto')",
        model,
        lambda model=model: load_checkpoint_and_dispatch(
            model, path, device_map="auto", offload_folder=folder
        ),
        Fails(CLEAR_ERRORS, pattern),
        (folder,),
    )


def damaged_copies(source: Path, scratch: Scratch, rng: random.Random) -> list[tuple[str, Path]]:
    raw = source.read_bytes()
    copies: list[tuple[str, bytes]] = []
    if source.suffix == ".safetensors":
        header_end = 8 + struct.unpack("<Q", raw[:8])[0]
        offsets = {0, 4, 8, 9, header_end // 2, header_end, header_end + 3, len(raw) - 1}
        offsets |= set(rng.sample(range(len(raw)), 6))
        copies += [(f"cut at {offset}", raw[:offset]) for offset in sorted(offsets)]
        for number in range(6):
            garbled = bytearray(raw)
            for position in rng.sample(range(8, header_end), 2):
                garbled[position] = rng.choice(b"\xff\x00\x01")
            copies.append((f"header garbled #{number}", bytes(garbled)))
        for number in range(3):
            wrong = struct.pack("<Q", rng.choice([0, 1, header_end + 1, 2**63, 2**64 - 1]))
            copies.append((f"header length garbled #{number}", wrong + raw[8:]))
        copies.append(("header not an object", struct.pack("<Q", 2) + b"[]" + raw[header_end:]))
    else:
        offsets = {0, 1, 10, len(raw) // 2, len(raw) - 1, *rng.sample(range(len(raw)), 5)}
        copies += [(f"cut at {offset}", raw[:offset]) for offset in sorted(offsets)]
        copies.append(("zip magic garbled", b"XX" + raw[2:]))
        copies.append(("end record garbled", raw[:-22] + bytes(b ^ 0x5A for b in raw[-22:])))
        copies.append(("every byte flipped", bytes(b ^ 0x33 for b in raw)))
        copies.append(("a pickle of a list", pickle.dumps([1, 2, 3])))
    result = []
    for label, data in copies:
        target = scratch.path("ckpt") / source.name
        target.parent.mkdir()
        target.write_bytes(data)
        result.append((f"{source.suffix} {label}", target))
    return result


def test_checkpoint_file_fuzz(
    files: Files, scratch: Scratch, capsys: pytest.CaptureFixture[str]
) -> None:
    fuzz = Fuzz()
    rng = random.Random(SEED + 3)
    for source in (files.safetensors, files.bin):
        for label, path in damaged_copies(source, scratch, rng):
            pattern = re.escape(str(path)) + r".*(safetensors|checkpoint|state dict|tensors)"
            for target_label, *rest in checkpoint_targets(path, scratch, pattern):
                fuzz.case(f"{label}: {target_label}", *rest)

    # Keys that do not fit: a weight missing, a weight renamed (strict), sharded indexes.
    state = {k: v.clone() for k, v in real_model().state_dict().items() if k != "head.weight"}
    lacking = scratch.path("lacking") / "model.safetensors"
    lacking.parent.mkdir()
    save_file({k: v for k, v in state.items() if k != WEIGHT}, lacking, {"format": "pt"})
    model = empty_model()
    fuzz.case(
        "weight missing: load_checkpoint_and_dispatch",
        model,
        lambda: load_checkpoint_and_dispatch(model, lacking, device_map={"": "cpu"}),
        Fails(MissingWeightsError, rf"missing key\(s\): \['{re.escape(WEIGHT)}'\].*not changed"),
    )
    model = empty_model()
    fuzz.case(
        "weight missing: load_checkpoint_and_dispatch('auto')",
        model,
        lambda: load_checkpoint_and_dispatch(model, lacking, device_map="auto"),
        Fails(MissingWeightsError, rf"'{re.escape(WEIGHT)}'"),
    )
    model = empty_model()
    fuzz.case(
        "weight missing: load_checkpoint_in_model(strict=True)",
        model,
        lambda: load_checkpoint_in_model(model, lacking, device_map=DISK_BLOCK, strict=True),
        Fails(RuntimeError, r"missing key\(s\).*not changed"),
    )
    wrong_shape = scratch.path("shape") / "model.safetensors"
    wrong_shape.parent.mkdir()
    save_file({**state, WEIGHT: torch.zeros(4, 5)}, wrong_shape, {"format": "pt"})
    model = empty_model()
    fuzz.case(
        "weight with another shape: load_checkpoint_in_model",
        model,
        lambda: load_checkpoint_in_model(model, wrong_shape, device_map=DISK_BLOCK),
        Fails(ValueError, rf"'{re.escape(WEIGHT)}': checkpoint .* shape \(4, 5\)"),
    )
    for label, content, pattern in [
        ("not JSON", b"{", r"is not valid JSON"),
        ("a list", b"[1]", r"must map tensor names to shard file names"),
        (
            "a missing shard",
            json.dumps({"weight_map": {WEIGHT: "nope.safetensors"}}).encode(),
            r"names the shard 'nope\.safetensors' but",
        ),
        (
            "a shard outside",
            json.dumps({"weight_map": {WEIGHT: "../model.safetensors"}}).encode(),
            r"outside its folder",
        ),
    ]:
        index = scratch.path("sharded") / "model.safetensors.index.json"
        index.parent.mkdir()
        index.write_bytes(content)
        model = empty_model()
        fuzz.case(
            f"sharded index {label}: load_checkpoint_in_model",
            model,
            lambda model=model, index=index: load_checkpoint_in_model(
                model, index, device_map={"": "cpu"}
            ),
            Fails(ValueError, r"checkpoint index .*" + pattern),
        )
    for label, path in [
        ("missing", files.root / "nope"),
        ("an empty folder", scratch.path("empty")),
    ]:
        if label == "an empty folder":
            path.mkdir()
        model = empty_model()
        fuzz.case(
            f"checkpoint {label}",
            model,
            lambda model=model, path=path: load_checkpoint_in_model(model, path),
            Fails(ValueError, re.escape(f"checkpoint={str(path)!r}")),
        )
    fuzz.report(capsys, "checkpoint file")
