"""The prefetching offload engine: exact outputs, call order, memory bound, failures, leaks."""

from __future__ import annotations

import concurrent.futures
import copy
import gc
import json
import logging
import os
import pickle
import re
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from accel_bigmodel.dispatch import (
    cpu_offload,
    disk_offload,
    dispatch_model,
    get_state_dict_offloaded_model,
    load_checkpoint_and_dispatch,
)
from accel_bigmodel.empty_init import init_empty_weights
from accel_bigmodel.hooks import (
    SYNCHRONOUS_MATERIALIZER,
    AlignDevicesHook,
    WeightMaterializer,
    find_align_devices_hook,
    remove_hook_from_submodules,
    set_weight_materializer,
)
from accel_bigmodel.offload import OffloadedWeightsLoader, PrefixedDataset, WeightLocation
from accel_bigmodel.prefetch import (
    DEFAULT_PREFETCH_DEPTH,
    PREFETCH_DEPTH_ENV,
    PrefetchingMaterializer,
    resolve_prefetch_depth,
)
from accel_bigmodel.prefetch.paging import PAGE, PAGER, Pager, Span
from accel_bigmodel.prefetch.plan import find_units, unit_plan
from accel_bigmodel.prefetch.worker import Worker

DEPTHS = (0, 1, 2, 3)


# Tiny tensors: intra-op threads only add waits (conftest.py).
pytestmark = pytest.mark.usefixtures("one_thread")


# -- a small decoder ----------------------------------------------------------------------

PROBE: list[Callable[[str], None]] = []
FAIL_IN: set[str] = set()


class ProbedLinear(nn.Linear):
    """A linear layer that, while its weights are materialised, calls the test's callbacks
    with its block's name (and raises when the test asks it to)."""

    def __init__(self, features: int, out_features: int, block_name: str) -> None:
        super().__init__(features, out_features)
        self.block_name = block_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        for callback in PROBE:
            callback(self.block_name)
        if self.block_name in FAIL_IN:
            raise RuntimeError(f"failure injected in {self.block_name}")
        return out


class Block(nn.Module):
    def __init__(self, dim: int, name: str) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = ProbedLinear(dim, 2 * dim, name)
        self.down = nn.Linear(2 * dim, dim)
        self.register_buffer("scale", torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(self.norm(x))
        return x + self.down(torch.relu(h)) * self.scale


class Decoder(nn.Module):
    def __init__(
        self,
        vocab: int = 32,
        dim: int = 16,
        layers: int = 4,
        tie: bool = False,
        order: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([Block(dim, f"layers.{i}") for i in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight
        self.order = tuple(range(layers)) if order is None else order

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for index in self.order:
            x = self.layers[index](x)
        return self.head(self.norm(x))


IDS = torch.tensor([[1, 5, 7, 3, 0, 2], [4, 4, 9, 31, 8, 6]])
LAYERS = tuple(f"layers.{i}" for i in range(4))


def _trained(model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("scale"):
                buffer.copy_(torch.rand_like(buffer) + 0.5)
    return model.eval()


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with one name per shared tensor (as HF saves tied models)."""
    seen: set[int] = set()
    state = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        state[name] = tensor.contiguous().clone()
    return state


def _write(model: nn.Module, folder: Path, kind: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    state = _state(model)
    if kind == "bin":
        path = folder / "pytorch_model.bin"
        torch.save(state, path)
        return path
    # Two shards, so a block can span files.
    names = list(state)
    weight_map = {}
    for number, shard in enumerate((names[: len(names) // 2], names[len(names) // 2 :]), 1):
        file_name = f"model-{number:05d}-of-00002.safetensors"
        save_file({n: state[n] for n in shard}, str(folder / file_name), {"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


@pytest.fixture(scope="module")
def reference() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {
        "plain": _trained(Decoder()),
        "tied": _trained(Decoder(tie=True)),
        "shuffled": _trained(Decoder(order=(2, 0, 3, 1))),
    }


@pytest.fixture(scope="module")
def checkpoints(
    tmp_path_factory: pytest.TempPathFactory, reference: dict[str, nn.Module]
) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("prefetch-ckpt")
    return {
        (name, kind): _write(reference[name], root / name / kind, kind)
        for name in ("plain", "tied")
        for kind in ("safetensors", "bin")
    }


def _empty(**kwargs: object) -> Decoder:
    with init_empty_weights():
        model = Decoder(**kwargs)  # type: ignore[arg-type]
    return model.eval()


ALL_DISK = {"embed": "cpu", **dict.fromkeys(LAYERS, "disk"), "norm": "cpu", "head": "cpu"}
MIXED = {
    "embed": "cpu",
    "layers.0": "disk",
    "layers.1": "cpu",
    "layers.2": "disk",
    "layers.3": "disk",
    "norm": "cpu",
    "head": "cpu",
}
TIED_DISK = {"embed": "disk", **dict.fromkeys(LAYERS, "disk"), "norm": "cpu", "head": "disk"}


# The models a test hooked: their engines are closed when it ends (closing joins the threads).
HOOKED: list[nn.Module] = []
PREFETCH_THREAD = "accel-offload-prefetch"


def _hooked(model: nn.Module) -> nn.Module:
    HOOKED.append(model)
    return model


def _prefetch_threads() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name == PREFETCH_THREAD}


@pytest.fixture(autouse=True)
def _close_engines() -> Iterator[None]:
    running = _prefetch_threads()
    yield
    for model in HOOKED:
        for engine in _engines(model):
            engine.close()
    HOOKED.clear()
    assert _prefetch_threads() <= running, "a prefetch thread outlived its test"


def _load(
    checkpoint: Path, device_map: dict[str, str], depth: int, tmp_path: Path, **kwargs: object
) -> Decoder:
    model = _empty(**kwargs)
    return _hooked(  # type: ignore[return-value]
        load_checkpoint_and_dispatch(
            model,
            checkpoint,
            device_map=device_map,
            offload_folder=tmp_path / "offload",
            prefetch_depth=depth,
        )
    )


def _engines(model: nn.Module) -> list[PrefetchingMaterializer]:
    found: list[PrefetchingMaterializer] = []
    for module in model.modules():
        hook = find_align_devices_hook(module)
        engine = None if hook is None else hook.materializer
        if isinstance(engine, PrefetchingMaterializer) and engine not in found:
            found.append(engine)
    return found


def _engine(model: nn.Module) -> PrefetchingMaterializer:
    engines = _engines(model)
    if not engines:
        raise AssertionError("no PrefetchingMaterializer installed")
    return engines[0]


def _offloaded_hooks(model: nn.Module) -> list[tuple[nn.Module, AlignDevicesHook]]:
    found = []
    for module in model.modules():
        hook = find_align_devices_hook(module)
        if hook is not None and hook.offload:
            found.append((module, hook))
    return found


def _materialised(model: nn.Module) -> dict[str, int]:
    """Per unit name (the module's top-level block), how many offloaded tensors are not meta."""
    counts: dict[str, int] = {}
    names = {id(module): name for name, module in model.named_modules()}
    for module, hook in _offloaded_hooks(model):
        prefix = names[id(module)]
        block = ".".join(prefix.split(".")[:2]) if prefix.startswith("layers.") else prefix
        for tensor_name in hook.offloaded_names:
            owner, _, leaf = tensor_name.rpartition(".")
            holder = module.get_submodule(owner) if owner else module
            tensor = holder._parameters.get(leaf)
            if tensor is None:
                tensor = holder._buffers.get(leaf)
            if tensor is not None and tensor.device.type != "meta":
                counts[block] = counts.get(block, 0) + 1
    return counts


@pytest.fixture(autouse=True)
def _reset_probes() -> Iterator[None]:
    yield
    PROBE.clear()
    FAIL_IN.clear()


# -- exact outputs ------------------------------------------------------------------------


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize(
    ("name", "kind", "device_map"),
    [
        ("plain", "safetensors", ALL_DISK),
        ("plain", "bin", ALL_DISK),
        ("plain", "safetensors", MIXED),
        ("tied", "safetensors", TIED_DISK),
        ("tied", "bin", TIED_DISK),
    ],
    ids=["safetensors-disk", "bin-dat-disk", "mixed-cpu-disk", "tied-safetensors", "tied-dat"],
)
def test_outputs_are_bit_identical_at_every_depth(
    depth: int,
    name: str,
    kind: str,
    device_map: dict[str, str],
    reference: dict[str, nn.Module],
    checkpoints: dict[tuple[str, str], Path],
    tmp_path: Path,
) -> None:
    expected = reference[name](IDS)
    model = _load(checkpoints[(name, kind)], device_map, depth, tmp_path, tie=name == "tied")
    engine = _engine(model)
    assert engine.prefetch_depth == depth
    synchronous = _load(
        checkpoints[(name, kind)], device_map, 0, tmp_path / "sync", tie=name == "tied"
    )
    set_weight_materializer(synchronous, SYNCHRONOUS_MATERIALIZER)
    baseline = synchronous(IDS)
    for _ in range(3):
        out = model(IDS)
        assert out.dtype == torch.float32
        assert torch.equal(out, baseline)
        assert torch.equal(out, expected)
        assert _materialised(model) == {}
        assert engine.prefetched_blocks() == []
    disk_layers = [n for n in LAYERS if device_map[n] == "disk"]
    assert [n for n in engine.block_order() if n.startswith("layers.")] == disk_layers


def test_disk_weights_are_paged_in_through_the_views_maps(
    checkpoints: dict[tuple[str, str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _load(checkpoints[("plain", "safetensors")], ALL_DISK, 1, tmp_path)
    engine = _engine(model)
    paged: list[Span] = []
    threads: set[int] = set()
    page_in = Pager.page_in

    def spy(pager: Pager, ranges: tuple[Span, ...], skip_resident: bool) -> None:
        threads.add(threading.get_ident())
        paged.extend(ranges)
        page_in(pager, ranges, skip_resident)

    monkeypatch.setattr(Pager, "page_in", spy)
    model(IDS)
    # Every block was paged in, by the background thread: the ranges of the units' plans.
    units = find_units(model)
    plans = [unit_plan(unit) for unit in units]
    assert sorted(paged) == sorted(r for plan in plans for r in plan.ranges)
    assert threads and threading.get_ident() not in threads
    if PAGER.madvise is not None and PAGER.mincore is not None:
        # Once populated, ranges still resident are only checked (mincore), not re-populated.
        calls: list[int] = []
        madvise = PAGER.madvise

        def counting(address: int, length: int, advice: int) -> int:
            calls.append(advice)
            return madvise(address, length, advice)

        monkeypatch.setattr(PAGER, "madvise", counting)
        model(IDS)
        assert calls == []
    assert [unit.name for unit in units] == engine.block_order() == list(LAYERS)
    for plan in plans:
        assert plan.files and plan.ranges
        assert all(need.path.endswith(".safetensors") for need in plan.files)
        assert all(span.address % PAGE == 0 for span in plan.ranges)
    # The ranges cover the bytes the weight views read.
    hook = find_align_devices_hook(model.layers[2].up)
    assert hook is not None and hook.weights_map is not None
    view = hook.weights_map["weight"]
    start, size = view.data_ptr(), view.numel() * view.element_size()
    assert any(a <= start and start + size <= a + n for a, n, _ in plans[2].ranges)


def test_io_same_device_and_cpu_and_disk_offload_are_exact(
    reference: dict[str, nn.Module], tmp_path: Path
) -> None:
    source = reference["tied"]
    expected = source(IDS)
    for depth in DEPTHS:
        model = copy.deepcopy(source)
        _hooked(cpu_offload(model, execution_device="cpu", prefetch_depth=depth))
        engine = _engine(model)
        assert engine.block_order()[:2] == ["embed", "layers.0.norm"]
        for _ in range(2):
            out = model(IDS)
            assert out.device == IDS.device and torch.equal(out, expected)
            assert _materialised(model) == {}

        model = copy.deepcopy(source)
        _hooked(
            disk_offload(
                model, tmp_path / f"disk-{depth}", execution_device="cpu", prefetch_depth=depth
            )
        )
        engine = _engine(model)
        for _ in range(2):
            assert torch.equal(model(IDS), expected)
            assert _materialised(model) == {}
        if depth:
            # Every unit's files are checked before its prefetch (and the order covers them).
            units = find_units(model)
            assert sorted(unit.name for unit in units) == sorted(engine.block_order())
            assert units and all(unit_plan(unit).files for unit in units)


def test_cpu_execution_never_touches_cuda(
    reference: dict[str, nn.Module],
    checkpoints: dict[tuple[str, str], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _load(checkpoints[("plain", "safetensors")], ALL_DISK, 2, tmp_path)

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("CUDA was touched during a CPU forward")

    for name in ("is_available", "current_device", "current_stream", "Stream", "Event"):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    for _ in range(2):
        assert torch.equal(model(IDS), reference["plain"](IDS))


def test_state_dict_of_a_prefetching_model(
    reference: dict[str, nn.Module], checkpoints: dict[tuple[str, str], Path], tmp_path: Path
) -> None:
    model = _load(checkpoints[("plain", "bin")], ALL_DISK, 1, tmp_path)
    model(IDS)
    state = get_state_dict_offloaded_model(model)
    expected = reference["plain"].state_dict()
    assert list(state) == list(expected)
    assert all(torch.equal(state[name], expected[name]) for name in expected)
    assert _materialised(model) == {}
    assert torch.equal(model(IDS), reference["plain"](IDS))


# -- call order ---------------------------------------------------------------------------


def test_call_order_is_learned_and_a_mismatch_falls_back_exactly(
    reference: dict[str, nn.Module], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = reference["shuffled"]
    expected = source(IDS)
    path = tmp_path / "shuffled"
    _write(source, path, "safetensors")
    model = _load(path, ALL_DISK, 1, tmp_path, order=(2, 0, 3, 1))
    engine = _engine(model)
    assert engine.block_order() == list(LAYERS)  # the device map's order before a forward

    prefetched: list[tuple[str, list[str]]] = []
    PROBE.append(lambda block: prefetched.append((block, engine.prefetched_blocks())))
    with caplog.at_level(logging.DEBUG, logger="accel_bigmodel.prefetch"):
        assert torch.equal(model(IDS), expected)
    assert "started where 'layers.0' was expected" in caplog.text
    # layers.2 ran first: nothing held from then on in this forward (synchronous).
    assert all(held == [] for _, held in prefetched)
    assert engine.block_order() == ["layers.2", "layers.0", "layers.3", "layers.1"]

    prefetched.clear()
    assert torch.equal(model(IDS), expected)
    assert prefetched == [
        ("layers.2", ["layers.2", "layers.0"]),
        ("layers.0", ["layers.0", "layers.3"]),
        ("layers.3", ["layers.3", "layers.1"]),
        ("layers.1", ["layers.1"]),
    ]

    # The model changes its order: fall back once, then follow the new one.
    model.order = source.order = (0, 1, 2, 3)
    try:
        in_order = source(IDS)
    finally:
        source.order = (2, 0, 3, 1)
    for _ in range(3):
        assert torch.equal(model(IDS), in_order)
        assert engine.block_order() == list(LAYERS)
    model.order = (2, 0, 3, 1)
    for _ in range(2):
        assert torch.equal(model(IDS), expected)
    assert engine.block_order() == ["layers.2", "layers.0", "layers.3", "layers.1"]


def test_a_block_called_twice_per_forward(
    reference: dict[str, nn.Module], checkpoints: dict[tuple[str, str], Path], tmp_path: Path
) -> None:
    source = copy.deepcopy(reference["plain"])
    source.order = (0, 1, 1, 3, 1)
    expected = source(IDS)
    model = _load(
        checkpoints[("plain", "safetensors")], ALL_DISK, 2, tmp_path, order=(0, 1, 1, 3, 1)
    )
    engine = _engine(model)
    held: list[list[str]] = []
    PROBE.append(lambda block: held.append(engine.prefetched_blocks()))
    for _ in range(3):
        held.clear()
        assert torch.equal(model(IDS), expected)
        assert _materialised(model) == {}
    assert engine.block_order() == ["layers.0", "layers.1", "layers.1", "layers.3", "layers.1"]
    assert held[1] == ["layers.1", "layers.1", "layers.3"]


def test_first_forward_follows_the_device_map_order(
    checkpoints: dict[tuple[str, str], Path], tmp_path: Path
) -> None:
    model = _load(checkpoints[("plain", "safetensors")], ALL_DISK, 2, tmp_path)
    engine = _engine(model)
    seen: list[tuple[str, list[str]]] = []
    PROBE.append(lambda block: seen.append((block, engine.prefetched_blocks())))
    model(IDS)
    assert seen == [
        ("layers.0", ["layers.0", "layers.1", "layers.2"]),
        ("layers.1", ["layers.1", "layers.2", "layers.3"]),
        ("layers.2", ["layers.2", "layers.3"]),
        ("layers.3", ["layers.3"]),
    ]


def test_a_block_called_outside_a_forward_loads_synchronously(
    reference: dict[str, nn.Module], checkpoints: dict[tuple[str, str], Path], tmp_path: Path
) -> None:
    model = _load(checkpoints[("plain", "safetensors")], ALL_DISK, 1, tmp_path)
    engine = _engine(model)
    x = torch.randn(2, 3, 16)
    expected = reference["plain"].layers[1](x)
    assert torch.equal(model.layers[1](x), expected)
    assert engine.prefetched_blocks() == [] and _materialised(model) == {}
    assert torch.equal(model(IDS), reference["plain"](IDS))


# -- memory bound -------------------------------------------------------------------------


@pytest.mark.parametrize("depth", DEPTHS)
def test_memory_bound_holds_during_a_forward(
    depth: int, checkpoints: dict[tuple[str, str], Path], tmp_path: Path
) -> None:
    model = _load(checkpoints[("plain", "safetensors")], ALL_DISK, depth, tmp_path)
    engine = _engine(model)
    observed: list[tuple[str, dict[str, int], list[str]]] = []
    PROBE.append(
        lambda block: observed.append((block, _materialised(model), engine.prefetched_blocks()))
    )
    for _ in range(3):
        observed.clear()
        model(IDS)
        assert [block for block, _, _ in observed] == list(LAYERS)
        for block, materialised, held in observed:
            # Inside a block only the running module's weights are materialised...
            assert materialised == {block: 2}
            # ...and the engine holds at most depth + 1 blocks, the running one first.
            assert len(held) <= depth + 1
            if depth:
                assert held[0] == block
                position = LAYERS.index(block)
                assert held == list(LAYERS[position : position + depth + 1])
            else:
                assert held == []
        assert _materialised(model) == {}
        assert engine.prefetched_blocks() == []


# -- failures -----------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_an_exception_inside_a_block_drains_and_the_next_forward_works(
    depth: int,
    reference: dict[str, nn.Module],
    checkpoints: dict[tuple[str, str], Path],
    tmp_path: Path,
) -> None:
    expected = reference["plain"](IDS)
    model = _load(checkpoints[("plain", "safetensors")], ALL_DISK, depth, tmp_path)
    engine = _engine(model)
    assert torch.equal(model(IDS), expected)
    FAIL_IN.add("layers.1")
    with pytest.raises(RuntimeError, match="failure injected in layers.1"):
        model(IDS)
    # The failed module's weights were left materialised by its hook, and are dropped.
    assert _materialised(model) == {}
    assert engine.prefetched_blocks() == []
    # The learned order is kept (a forward that stopped early does not shorten it).
    assert engine.block_order() == list(LAYERS)
    FAIL_IN.clear()
    # The failed forward ended for the engine too: the next one is learned when it finishes.
    model.order = (3, 2, 1, 0)
    model(IDS)
    assert engine.block_order() == list(reversed(LAYERS))
    model.order = (0, 1, 2, 3)
    for _ in range(2):
        assert torch.equal(model(IDS), expected)
        assert _materialised(model) == {}


def test_a_deleted_safetensors_file_is_named_by_the_next_forward(
    reference: dict[str, nn.Module], tmp_path: Path
) -> None:
    for depth in (0, 1, 2):
        folder = tmp_path / f"ckpt-{depth}"
        _write(reference["plain"], folder, "safetensors")
        model = _load(folder, ALL_DISK, depth, tmp_path)
        assert torch.equal(model(IDS), reference["plain"](IDS))
        shard = folder / "model-00002-of-00002.safetensors"
        shard.unlink()
        with pytest.raises(FileNotFoundError, match=re.escape(str(shard))) as caught:
            model(IDS)
        assert "no longer exists" in str(caught.value)
        assert _materialised(model) == {}
        assert _engine(model).prefetched_blocks() == []


def test_a_deleted_or_truncated_dat_file_is_named_not_a_sigbus(
    reference: dict[str, nn.Module], checkpoints: dict[tuple[str, str], Path], tmp_path: Path
) -> None:
    model = _load(checkpoints[("plain", "bin")], ALL_DISK, 1, tmp_path)
    assert torch.equal(model(IDS), reference["plain"](IDS))
    weight = tmp_path / "offload" / "layers.3.down.weight.dat"
    assert weight.is_file()
    size = weight.stat().st_size
    os.truncate(weight, size // 2)
    with pytest.raises(ValueError, match=re.escape(f"{weight} has {size // 2} bytes")):
        model(IDS)
    assert _materialised(model) == {}
    weight.unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(str(weight))):
        model(IDS)


def test_a_truncated_safetensors_file_is_named_not_a_sigbus(
    reference: dict[str, nn.Module], tmp_path: Path
) -> None:
    folder = tmp_path / "ckpt"
    _write(reference["plain"], folder, "safetensors")
    model = _load(folder, ALL_DISK, 1, tmp_path)
    assert torch.equal(model(IDS), reference["plain"](IDS))  # pages mapped
    shard = folder / "model-00002-of-00002.safetensors"
    os.truncate(shard, 64)
    with pytest.raises(ValueError, match=re.escape(f"{shard} has 64 bytes")):
        model(IDS)


def test_a_failing_prefetch_falls_back_to_the_synchronous_path(
    reference: dict[str, nn.Module],
    checkpoints: dict[tuple[str, str], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = _load(checkpoints[("plain", "safetensors")], ALL_DISK, 1, tmp_path)

    def broken(pager: Pager, ranges: object, skip_resident: bool) -> None:
        raise MemoryError("no room to page in")

    monkeypatch.setattr(Pager, "page_in", broken)
    with caplog.at_level(logging.WARNING, logger="accel_bigmodel.prefetch"):
        assert torch.equal(model(IDS), reference["plain"](IDS))
        assert torch.equal(model(IDS), reference["plain"](IDS))
    assert caplog.text.count("loading synchronously") == 1
    assert "MemoryError: no room to page in" in caplog.text


# -- generation loops ---------------------------------------------------------------------


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for item in gc.get_objects() if issubclass(type(item), torch.Tensor))


def test_a_hundred_forwards_do_not_grow(
    reference: dict[str, nn.Module], checkpoints: dict[tuple[str, str], Path], tmp_path: Path
) -> None:
    expected = reference["plain"](IDS)
    running = _prefetch_threads()
    model = _load(checkpoints[("plain", "safetensors")], ALL_DISK, 2, tmp_path)
    engine = _engine(model)
    with torch.no_grad():
        for _ in range(5):
            model(IDS)
        (engine_thread,) = _prefetch_threads() - running
        tensors = _live_tensors()
        process = psutil.Process()
        rss = process.memory_info().rss
        for _ in range(100):
            out = model(IDS)
            assert _materialised(model) == {}
            assert engine.prefetched_blocks() == []
        del out
    assert _live_tensors() <= tensors
    assert process.memory_info().rss - rss < 16 * 2**20
    # The same one thread served every forward.
    assert _prefetch_threads() - running == {engine_thread} and engine_thread.is_alive()
    assert torch.equal(model(IDS), expected)


# -- bad input and no-ops -----------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_bad_prefetch_depth_is_refused_naming_the_argument(
    bad: object, checkpoints: dict[tuple[str, str], Path], tmp_path: Path
) -> None:
    message = re.escape(f"prefetch_depth={bad!r} is not a prefetch depth: use an int >= 0")
    with pytest.raises(ValueError, match=message):
        PrefetchingMaterializer(bad)  # type: ignore[arg-type]
    model = _empty()
    with pytest.raises(ValueError, match=message):
        load_checkpoint_and_dispatch(
            model,
            checkpoints[("plain", "safetensors")],
            device_map=ALL_DISK,
            prefetch_depth=bad,  # type: ignore[arg-type]
        )
    assert model.layers[0].up.weight.device.type == "meta"  # nothing was loaded
    plain = _trained(Decoder())
    calls: list[Callable[[], nn.Module]] = [
        lambda: dispatch_model(plain, ALL_DISK, offload_dir=tmp_path, prefetch_depth=bad),  # type: ignore[arg-type]
        lambda: cpu_offload(plain, prefetch_depth=bad),  # type: ignore[arg-type]
        lambda: disk_offload(plain, tmp_path / "d", prefetch_depth=bad),  # type: ignore[arg-type]
    ]
    for call in calls:
        with pytest.raises(ValueError, match=message):
            call()
        assert find_align_devices_hook(plain) is None
    assert not (tmp_path / "d").exists()


def test_the_environment_sets_the_default_depth(
    monkeypatch: pytest.MonkeyPatch, reference: dict[str, nn.Module]
) -> None:
    assert resolve_prefetch_depth(None) == DEFAULT_PREFETCH_DEPTH == 1
    monkeypatch.setenv(PREFETCH_DEPTH_ENV, "3")
    assert resolve_prefetch_depth(None) == 3
    assert resolve_prefetch_depth(0) == 0
    model = copy.deepcopy(reference["plain"])
    _hooked(cpu_offload(model))
    assert _engine(model).prefetch_depth == 3
    for bad in ("-2", "two", "1.0"):
        monkeypatch.setenv(PREFETCH_DEPTH_ENV, bad)
        with pytest.raises(ValueError, match=f"{PREFETCH_DEPTH_ENV}={bad!r}"):
            resolve_prefetch_depth(None)
    monkeypatch.setenv(PREFETCH_DEPTH_ENV, " ")
    assert resolve_prefetch_depth(None) == 1


def test_a_map_without_offloaded_blocks_is_a_debug_no_op(
    reference: dict[str, nn.Module], caplog: pytest.LogCaptureFixture
) -> None:
    expected = reference["plain"](IDS)
    device_map = dict.fromkeys(("embed", *LAYERS, "norm", "head"), "cpu")
    with caplog.at_level(logging.DEBUG, logger="accel_bigmodel"):
        model = dispatch_model(copy.deepcopy(reference["plain"]), device_map, prefetch_depth=2)
        hooked = dispatch_model(
            copy.deepcopy(reference["plain"]), device_map, force_hooks=True, prefetch_depth=2
        )
    assert caplog.text.count("nothing to prefetch") == 2
    assert torch.equal(model(IDS), expected) and torch.equal(hooked(IDS), expected)
    assert all(
        hook.materializer is SYNCHRONOUS_MATERIALIZER
        for module in hooked.modules()
        if (hook := find_align_devices_hook(module)) is not None
    )


# -- lifetime -----------------------------------------------------------------------------


def _threads_started(action: Callable[[], object]) -> set[threading.Thread]:
    """The threads that ``action`` started and that still run after it."""
    running = set(threading.enumerate())
    action()
    return set(threading.enumerate()) - running


def test_binding_replacing_and_removing_close_the_engine(
    reference: dict[str, nn.Module], checkpoints: dict[tuple[str, str], Path], tmp_path: Path
) -> None:
    expected = reference["plain"](IDS)
    model = _load(checkpoints[("plain", "safetensors")], ALL_DISK, 1, tmp_path)
    first = _engine(model)
    assert isinstance(first, WeightMaterializer)
    # The thread starts lazily: with the first forward, not when the engine is installed.
    (first_thread,) = _threads_started(lambda: model(IDS))
    assert first_thread.is_alive() and first_thread.daemon
    assert first_thread.name == "accel-offload-prefetch"

    other = _load(checkpoints[("plain", "safetensors")], ALL_DISK, 1, tmp_path / "other")
    (other_thread,) = _threads_started(lambda: other(IDS))
    with pytest.raises(ValueError, match="already bound to a Decoder"):
        set_weight_materializer(other, first)
    assert _engine(other) is not first

    second = PrefetchingMaterializer(2)
    set_weight_materializer(model, second)
    # Replacing the engine closed it: thread stopped, model forgotten.
    assert not first_thread.is_alive() and first.block_order() == []
    outputs: list[torch.Tensor] = []
    (second_thread,) = _threads_started(lambda: outputs.append(model(IDS)))
    assert torch.equal(outputs[-1], expected)
    assert second_thread.is_alive() and other_thread.is_alive()
    remove_hook_from_submodules(other)
    assert not other_thread.is_alive()
    set_weight_materializer(model, SYNCHRONOUS_MATERIALIZER)
    assert not second_thread.is_alive()
    assert torch.equal(model(IDS), expected)
    # A closed engine still serves hooks that point to it (synchronously, with no thread).
    hook = find_align_devices_hook(model.layers[0].up)
    assert hook is not None
    hook.materializer = second
    assert _threads_started(lambda: outputs.append(model(IDS))) == set()
    assert torch.equal(outputs[-1], expected)
    assert second.block_order() == [] and second.prefetched_blocks() == []


def test_copies_of_the_engine_are_fresh_and_unbound(
    checkpoints: dict[tuple[str, str], Path], tmp_path: Path
) -> None:
    model = _load(checkpoints[("plain", "safetensors")], ALL_DISK, 2, tmp_path)
    engine = _engine(model)
    for clone in (copy.deepcopy(engine), pickle.loads(pickle.dumps(engine))):
        assert isinstance(clone, PrefetchingMaterializer)
        assert clone.prefetch_depth == 2 and clone.block_order() == []
    assert repr(engine) == "PrefetchingMaterializer(prefetch_depth=2)"


def _forward_hooks(model: nn.Module) -> tuple[int, int]:
    return len(model._forward_pre_hooks), len(model._forward_hooks)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("offload", ["cpu", "disk", "checkpoint"])
def test_a_copy_of_an_offloaded_model_prefetches_with_its_own_engine(
    reference: dict[str, nn.Module],
    checkpoints: dict[tuple[str, str], Path],
    tmp_path: Path,
    how: str,
    offload: str,
) -> None:
    if offload == "checkpoint":
        model = _load(checkpoints[("plain", "safetensors")], MIXED, 2, tmp_path)
    else:
        model = copy.deepcopy(reference["plain"])
        if offload == "cpu":
            _hooked(cpu_offload(model, prefetch_depth=2))
        else:
            _hooked(disk_offload(model, tmp_path / "offload", prefetch_depth=2))
    expected = reference["plain"](IDS)
    assert torch.equal(model(IDS), expected)
    engine = _engine(model)
    hooks = _forward_hooks(model)
    clone = _hooked(
        copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    )
    copied = _engine(clone)
    assert copied is not engine and copied.prefetch_depth == 2
    assert copied.block_order() == []  # bound by its first forward, not by the copy
    assert torch.equal(clone(IDS), expected)
    # Bound to the copy: it learned the copy's blocks, and replaced the copied forward hooks.
    assert copied.block_order() == engine.block_order() != []
    assert _forward_hooks(clone) == hooks
    before = _threads_started(lambda: [clone(IDS) for _ in range(2)])
    assert len(before) <= 1  # at most the copy's own worker
    assert torch.equal(clone(IDS), expected) and torch.equal(model(IDS), expected)
    assert _materialised(clone) == {}
    engine.close()  # closing the original leaves the copy working
    assert torch.equal(clone(IDS), expected)
    copied.close()
    assert _forward_hooks(clone) == (0, 0)
    assert torch.equal(clone(IDS), expected)  # synchronous from now on


# -- the background thread ----------------------------------------------------------------


def test_the_worker_runs_jobs_in_order_and_lets_go_of_a_cancelled_one() -> None:
    worker = Worker()
    try:
        gate = threading.Event()
        ran: list[str] = []
        blocked = worker.submit(gate.wait)

        def record() -> int:
            ran.append("first")
            return 1

        first = worker.submit(record)

        class Job:
            def __call__(self) -> None:
                ran.append("cancelled")

        job = Job()
        job_alive = weakref.ref(job)
        cancelled = worker.submit(job)
        del job
        # Cancelled while queued: the queue no longer holds the job (nor what it references).
        assert cancelled.cancel() and job_alive() is None
        failing = worker.submit(lambda: 1 / 0)
        gate.set()
        assert blocked.result(timeout=30) is True and first.result(timeout=30) == 1
        with pytest.raises(ZeroDivisionError):
            failing.result(timeout=30)
        assert ran == ["first"] and worker.alive
        # Once the worker reached it, the cancelled future counts as done for a waiter too.
        done, _ = concurrent.futures.wait([cancelled], timeout=30)
        assert done == {cancelled}
    finally:
        worker.shutdown()
    assert not worker.alive


# -- the loader's file locations ----------------------------------------------------------


def test_weight_location_and_mapped_bytes(tmp_path: Path) -> None:
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4)}
    save_file(tensors, str(tmp_path / "w.safetensors"))
    index = {
        name: {
            "safetensors_file": str(tmp_path / "w.safetensors"),
            "weight_name": name,
            "dtype": "float32",
            "shape": list(tensor.shape),
        }
        for name, tensor in tensors.items()
    }
    folder = tmp_path / "folder"
    from accel_bigmodel.offload import offload_state_dict

    offload_state_dict(folder, {"c": torch.full((3,), 2.0), "empty": torch.ones(0)})
    disk = json.loads((folder / "index.json").read_text())
    loader = OffloadedWeightsLoader(
        state_dict={"mem": torch.zeros(2)}, save_folder=folder, index={**index, **disk}
    )
    location = loader.weight_location("a")
    assert isinstance(location, WeightLocation)
    assert location.path == str(tmp_path / "w.safetensors") and location.length == 24
    with open(location.path, "rb") as handle:
        handle.seek(location.offset)
        assert handle.read(location.length) == tensors["a"].numpy().tobytes()
    assert loader.weight_location("c") == WeightLocation(str(folder / "c.dat"), 0, 12)
    assert loader.weight_location("mem") is None and loader.weight_location("empty") is None
    with pytest.raises(KeyError):
        loader.weight_location("nope")
    view = loader.mapped_bytes("a")
    assert view is not None and view.dtype == torch.uint8 and view.numel() == 24
    assert view.data_ptr() == loader["a"].data_ptr()  # the same map as the weight views
    dat = loader.mapped_bytes("c")
    assert dat is not None and dat.data_ptr() == loader["c"].data_ptr()
    assert loader.mapped_bytes("mem") is None and loader.mapped_bytes("empty") is None
    prefixed = PrefixedDataset({"x.a": torch.zeros(1)}, "x.")
    assert prefixed.weight_location("a") is None and prefixed.mapped_bytes("a") is None
    nested = PrefixedDataset(loader, "")
    assert nested.weight_location("a") == location
