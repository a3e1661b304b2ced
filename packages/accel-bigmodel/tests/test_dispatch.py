"""dispatch_model, load_checkpoint_and_dispatch, cpu/disk offload and offloaded state dicts."""

from __future__ import annotations

import copy
import io
import itertools
import json
import logging
import os
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from accel_bigmodel import dispatch as dispatch_module
from accel_bigmodel.dispatch import (
    DEVICE_MAP_STRATEGIES,
    cpu_offload,
    cpu_offload_with_hook,
    disk_offload,
    dispatch_model,
    get_state_dict_offloaded_model,
    load_checkpoint_and_dispatch,
)
from accel_bigmodel.empty_init import init_empty_weights
from accel_bigmodel.hooks import (
    AlignDevicesHook,
    CpuOffload,
    find_align_devices_hook,
    get_block_hooks,
    has_offloaded_params,
    remove_hook_from_submodules,
)
from accel_bigmodel.loading import load_checkpoint_in_model
from accel_bigmodel.offload import offload_state_dict, registered_offload_index

# Tiny tensors: intra-op threads only add waits (conftest.py).
pytestmark = pytest.mark.usefixtures("one_thread")


# -- models -------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, context: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        mask = torch.full((context, context), float("-inf")).triu(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / (q.shape[-1] ** 0.5) + self.mask[:length, :length]
        out = scores.softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(batch, length, dim))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, context: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, context)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """A decoder with its embedding tied to the LM head and a root-level parameter."""

    def __init__(self, vocab: int = 32, dim: int = 16, layers: int = 2, context: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(context, dim) * 0.02)
        self.blocks = nn.ModuleList([Block(dim, 2, context) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


LM_BLOCKS = ("embed", "pos", "blocks.0", "blocks.1", "ln_f", "lm_head")


def _trained(model: nn.Module) -> nn.Module:
    """Give every tensor non-trivial values (LayerNorm/BatchNorm start at 1/0)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.5)
        for module in model.modules():
            if isinstance(module, nn.BatchNorm1d):
                assert module.running_mean is not None and module.running_var is not None
                module.running_mean.copy_(torch.randn_like(module.running_mean))
                module.running_var.copy_(torch.rand_like(module.running_var) + 0.5)
                module.num_batches_tracked.fill_(7)
    return model.eval()


@pytest.fixture(scope="module")
def lm() -> TinyLM:
    torch.manual_seed(0)
    return _trained(TinyLM())  # type: ignore[return-value]


@pytest.fixture(scope="module")
def mlp() -> MLP:
    torch.manual_seed(0)
    return _trained(MLP())  # type: ignore[return-value]


IDS = torch.tensor([[1, 5, 7, 3, 0, 2], [4, 4, 9, 31, 8, 6]])
X = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))


def _dedup_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as HF saves tied models: one name per shared tensor."""
    seen: set[int] = set()
    state = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        state[name] = tensor.contiguous().clone()
    return state


def _write_checkpoint(model: nn.Module, folder: Path, kind: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "safetensors":
        path = folder / "model.safetensors"
        save_file(_dedup_state(model), str(path), metadata={"format": "pt"})
        return path
    if kind == "sharded":
        state = _dedup_state(model)
        names = list(state)
        shards = [names[: len(names) // 2], names[len(names) // 2 :]]
        weight_map = {}
        for number, shard in enumerate(shards, start=1):
            file_name = f"model-{number:05d}-of-00002.safetensors"
            save_file({n: state[n] for n in shard}, str(folder / file_name), {"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file_name))
        index = folder / "model.safetensors.index.json"
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        return folder
    path = folder / "pytorch_model.bin"
    torch.save(model.state_dict(), path)
    return path


@pytest.fixture(scope="module")
def checkpoints(
    tmp_path_factory: pytest.TempPathFactory, lm: TinyLM, mlp: MLP
) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {
        (name, kind): _write_checkpoint(model, root / name / kind, kind)
        for name, model in (("lm", lm), ("mlp", mlp))
        for kind in ("safetensors", "sharded", "bin")
    }


def _folder_bytes(folder: Path) -> int:
    if not folder.exists():
        return 0
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def _empty_lm() -> TinyLM:
    torch.manual_seed(123)
    with init_empty_weights():
        model = TinyLM()
    assert model.lm_head.weight is model.embed.weight
    return model.eval()


def _empty_mlp() -> MLP:
    with init_empty_weights():
        model = MLP()
    return model.eval()


# -- load_checkpoint_and_dispatch: every placement ----------------------------------------


def _placements(blocks: tuple[str, ...]) -> Iterator[dict[str, str]]:
    for devices in itertools.product(("cpu", "disk"), repeat=len(blocks)):
        yield dict(zip(blocks, devices, strict=True))


@pytest.mark.parametrize("device_map", list(_placements(LM_BLOCKS)), ids=str)
def test_lm_every_cpu_disk_mix_is_exact(
    device_map: dict[str, str],
    lm: TinyLM,
    checkpoints: dict[tuple[str, str], Path],
    tmp_path: Path,
) -> None:
    expected = lm(IDS)
    offload = tmp_path / "offload"
    model = load_checkpoint_and_dispatch(
        _empty_lm(), checkpoints["lm", "safetensors"], device_map, offload_folder=offload
    )
    assert model.hf_device_map == device_map
    for _ in range(2):  # the second call reuses the hooks after offloading
        assert torch.equal(model(IDS), expected)
    assert _folder_bytes(offload) == 0
    partner = {"embed": "lm_head", "lm_head": "embed"}
    for name, device in device_map.items():
        if device != "disk" or name == "pos" or device_map.get(partner.get(name, "")) == "cpu":
            continue  # a weight tied to a resident one points at it (Accelerate's retie)
        assert all(p.device.type == "meta" for p in model.get_submodule(name).parameters())


@pytest.mark.parametrize("kind", ["sharded", "bin"])
@pytest.mark.parametrize(
    "device_map",
    [
        {
            "embed": "disk",
            "pos": "cpu",
            "blocks.0": "cpu",
            "blocks.1": "disk",
            "ln_f": "disk",
            "lm_head": "cpu",
        },
        {"embed": "cpu", "pos": "disk", "blocks": "disk", "ln_f": "cpu", "lm_head": "disk"},
        {"": "disk"},
    ],
    ids=["mixed", "tied-split", "all-disk"],
)
def test_lm_sharded_and_bin_checkpoints(
    kind: str,
    device_map: dict[str, str],
    lm: TinyLM,
    checkpoints: dict[tuple[str, str], Path],
    tmp_path: Path,
) -> None:
    expected = lm(IDS)
    offload = tmp_path / "offload"
    model = load_checkpoint_and_dispatch(
        _empty_lm(), checkpoints["lm", kind], device_map, offload_folder=offload
    )
    assert model.hf_device_map == device_map
    assert torch.equal(model(IDS), expected)
    assert torch.equal(model(IDS), expected)
    if kind == "bin":
        assert sorted(p.name for p in offload.glob("*.dat"))  # .dat copies of disk weights
        assert (offload / "index.json").is_file()
    else:
        assert _folder_bytes(offload) == 0


@pytest.mark.parametrize("kind", ["safetensors", "sharded", "bin"])
@pytest.mark.parametrize("device_map", list(_placements(("fc1", "norm", "fc2"))), ids=str)
def test_mlp_every_cpu_disk_mix_is_exact(
    kind: str,
    device_map: dict[str, str],
    mlp: MLP,
    checkpoints: dict[tuple[str, str], Path],
    tmp_path: Path,
) -> None:
    expected = mlp(X)
    model = load_checkpoint_and_dispatch(
        _empty_mlp(), checkpoints["mlp", kind], device_map, offload_folder=tmp_path / "off"
    )
    assert model.hf_device_map == device_map
    assert torch.equal(model(X), expected)
    assert torch.equal(model(X), expected)


def test_disk_weights_are_zero_copy_views_of_the_checkpoint(
    lm: TinyLM, checkpoints: dict[tuple[str, str], Path]
) -> None:
    device_map = dict.fromkeys(LM_BLOCKS, "cpu") | {"blocks.1": "disk"}
    model = load_checkpoint_and_dispatch(_empty_lm(), checkpoints["lm", "safetensors"], device_map)
    linear = model.blocks[1].mlp[0]
    hook = find_align_devices_hook(linear)
    assert hook is not None and hook.offload and hook.weights_map is not None
    source = hook.weights_map["weight"]
    seen: list[int] = []

    original = linear.__dict__["_old_forward"]

    def spy(x: torch.Tensor) -> torch.Tensor:
        seen.append(linear.weight.data_ptr())
        return original(x)

    linear.__dict__["_old_forward"] = spy
    model(IDS)
    assert seen == [source.data_ptr()]
    assert linear.weight.device.type == "meta"


def test_auto_device_map_with_a_small_budget_reads_disk_weights_in_place(
    lm: TinyLM, checkpoints: dict[tuple[str, str], Path], tmp_path: Path
) -> None:
    offload = tmp_path / "offload"
    model = load_checkpoint_and_dispatch(
        _empty_lm(),
        checkpoints["lm", "sharded"],
        "sequential",
        max_memory={"cpu": 12000},
        no_split_module_classes=["Block"],
        offload_folder=offload,
    )
    assert "disk" in model.hf_device_map.values()
    assert "cpu" in model.hf_device_map.values()
    assert torch.equal(model(IDS), lm(IDS))
    assert _folder_bytes(offload) == 0


def test_budget_too_small_for_a_bin_checkpoint_without_folder(
    checkpoints: dict[tuple[str, str], Path],
) -> None:
    model = _empty_lm()
    with pytest.raises(ValueError, match=r"does not fit in max_memory=.*offload_folder") as err:
        load_checkpoint_and_dispatch(
            model, checkpoints["lm", "bin"], "sequential", max_memory={"cpu": 3000}
        )
    assert "'disk'" in str(err.value)
    assert all(p.device.type == "meta" for p in model.parameters())


def test_safetensors_needs_no_offload_folder(
    lm: TinyLM, checkpoints: dict[tuple[str, str], Path]
) -> None:
    model = load_checkpoint_and_dispatch(
        _empty_lm(), checkpoints["lm", "safetensors"], "auto", max_memory={"cpu": 3000}
    )
    assert "disk" in model.hf_device_map.values()
    assert torch.equal(model(IDS), lm(IDS))


def test_unknown_device_map_string_lists_the_strategies(
    checkpoints: dict[tuple[str, str], Path],
) -> None:
    with pytest.raises(ValueError, match="'auto', 'balanced', 'balanced_low_0', 'sequential'"):
        load_checkpoint_and_dispatch(_empty_lm(), checkpoints["lm", "bin"], "fastest")
    with pytest.raises(TypeError, match="device_map has type list"):
        load_checkpoint_and_dispatch(_empty_lm(), checkpoints["lm", "bin"], ["cpu"])  # type: ignore[arg-type]
    assert DEVICE_MAP_STRATEGIES == ("auto", "balanced", "balanced_low_0", "sequential")


def test_balanced_strategies_use_balanced_memory(
    monkeypatch: pytest.MonkeyPatch, lm: TinyLM, checkpoints: dict[tuple[str, str], Path]
) -> None:
    calls: list[bool] = []
    real = dispatch_module.get_balanced_memory

    def spy(*args: object, low_zero: bool = False, **kwargs: object) -> object:
        calls.append(low_zero)
        return real(*args, low_zero=low_zero, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(dispatch_module, "get_balanced_memory", spy)
    for strategy in DEVICE_MAP_STRATEGIES:
        model = load_checkpoint_and_dispatch(
            _empty_lm(), checkpoints["lm", "safetensors"], strategy, max_memory={"cpu": 10**6}
        )
        assert model.hf_device_map == {"": "cpu"}
        assert torch.equal(model(IDS), lm(IDS))
    assert calls == [False, False, True]


def test_device_map_none_only_loads(lm: TinyLM, checkpoints: dict[tuple[str, str], Path]) -> None:
    model = load_checkpoint_and_dispatch(_empty_lm(), checkpoints["lm", "bin"])
    assert not hasattr(model, "hf_device_map")
    assert torch.equal(model(IDS), lm(IDS))


# -- dispatch_model ----------------------------------------------------------------------


def test_single_device_is_a_plain_move(mlp: MLP) -> None:
    model = _trained(MLP())
    dispatch_model(model, {"": "cpu"})
    assert model.hf_device_map == {"": "cpu"}
    assert find_align_devices_hook(model) is None
    assert "forward" not in model.__dict__ and "to" not in model.__dict__
    assert torch.equal(model(X), mlp(X))


def test_force_hooks_on_a_single_device(mlp: MLP) -> None:
    model = _trained(MLP())
    dispatch_model(model, {"fc1": "cpu", "norm": "cpu", "fc2": "cpu"}, force_hooks=True)
    blocks = get_block_hooks(model)
    assert [hook.block_name for hook in blocks] == ["fc1", "norm", "fc2"]
    assert [hook.next_block_hook for hook in blocks] == [blocks[1], blocks[2], None]
    assert all(not hook.block_offload_hooks for hook in blocks)
    assert torch.equal(model(X), mlp(X))


def test_dispatch_of_an_in_memory_model_writes_disk_blocks_once(mlp: MLP, tmp_path: Path) -> None:
    model = _trained(MLP())
    device_map = {"fc1": "disk", "norm": "cpu", "fc2": "disk"}
    dispatch_model(model, device_map, offload_dir=tmp_path)
    index = json.loads((tmp_path / "index.json").read_text())
    assert sorted(index) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    assert model.fc1.weight.device.type == "meta"
    assert torch.equal(model(X), mlp(X))
    blocks = get_block_hooks(model)
    assert [hook.block_name for hook in blocks] == ["fc1", "norm", "fc2"]
    assert [len(hook.block_offload_hooks) for hook in blocks] == [1, 0, 1]


def test_dispatch_reuses_an_existing_offload_folder(mlp: MLP, tmp_path: Path) -> None:
    offload_state_dict(tmp_path, {k: v for k, v in mlp.state_dict().items() if "fc" in k})
    with init_empty_weights():
        model = MLP().eval()
    model.norm.load_state_dict(mlp.norm.state_dict(), assign=True)
    dispatch_model(model, {"fc1": "disk", "norm": "cpu", "fc2": "disk"}, offload_dir=tmp_path)
    assert torch.equal(model(X), mlp(X))


def test_explicit_offload_index(mlp: MLP, tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in mlp.state_dict().items()}, str(path))
    index = {
        name: {"safetensors_file": str(path), "weight_name": name, "dtype": "float32"}
        for name in ("fc1.weight", "fc1.bias")
    }
    with init_empty_weights():
        model = MLP().eval()
    state = {k: v for k, v in mlp.state_dict().items() if not k.startswith("fc1")}
    model.load_state_dict(state, strict=False, assign=True)
    dispatch_model(model, {"fc1": "disk", "norm": "cpu", "fc2": "cpu"}, offload_index=index)
    assert torch.equal(model(X), mlp(X))


def test_missing_parameter_is_named(mlp: MLP) -> None:
    model = _trained(MLP())
    with pytest.raises(ValueError, match="fc2.weight"):
        dispatch_model(model, {"fc1": "cpu", "norm": "cpu"})
    assert not hasattr(model, "hf_device_map")


def test_bad_device_string_is_refused() -> None:
    model = _trained(MLP())
    with pytest.raises(ValueError, match=r"device_map\['fc2'\]='gpu0'.*accepted|use"):
        dispatch_model(model, {"fc1": "cpu", "norm": "cpu", "fc2": "gpu0"})
    assert find_align_devices_hook(model.fc1) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("gpu", [0, "cuda:1", "cuda"])
def test_a_gpu_on_a_machine_without_one_is_refused_before_anything_changes(
    gpu: object, tmp_path: Path
) -> None:
    model = _trained(MLP())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    device_map = {"fc1": gpu, "norm": "cpu", "fc2": "cpu"}
    with pytest.raises(ValueError, match=r"device_map\['fc1'\] is cuda.*no cuda device"):
        dispatch_model(model, device_map)
    assert all(find_align_devices_hook(m) is None for m in model.modules())
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())
    # Loading refuses it the same way, before a tensor leaves the meta device.
    save_file({k: v.contiguous() for k, v in before.items()}, tmp_path / "w.safetensors")
    empty = _empty_mlp()
    with pytest.raises(ValueError, match=r"device_map\['fc1'\] is cuda.*use 'cpu' or 'disk'"):
        load_checkpoint_in_model(empty, tmp_path / "w.safetensors", device_map=device_map)
    assert all(p.device.type == "meta" for p in empty.parameters())


def test_disk_without_offload_dir_is_refused_and_model_unchanged() -> None:
    model = _trained(MLP())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="needs an offload_dir.*'fc2.weight'"):
        dispatch_model(model, {"fc1": "cpu", "norm": "cpu", "fc2": "disk"})
    assert all(find_align_devices_hook(m) is None for m in model.modules())
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name])


def test_meta_weights_without_any_source_are_refused() -> None:
    model = _empty_mlp()
    with pytest.raises(ValueError, match="'fc1.weight'.*meta device"):
        dispatch_model(model, {"fc1": "disk", "norm": "disk", "fc2": "disk"})
    with pytest.raises(ValueError, match="meta device"):
        dispatch_model(model, {"": "cpu"})
    model.fc2.load_state_dict(_trained(MLP()).fc2.state_dict(), assign=True)
    model.norm.load_state_dict(_trained(MLP()).norm.state_dict(), assign=True)
    with pytest.raises(ValueError, match="'fc1.weight', 'fc1.bias' are on the meta device .never"):
        dispatch_model(model, {"fc1": "cpu", "norm": "cpu", "fc2": "disk"}, offload_dir="x")
    assert not os.path.exists("x")


def test_main_device_disk_is_refused(mlp: MLP, tmp_path: Path) -> None:
    model = _trained(MLP())
    with pytest.raises(ValueError, match="main_device='disk'"):
        dispatch_model(
            model,
            {"fc1": "cpu", "norm": "cpu", "fc2": "disk"},
            main_device="disk",
            offload_dir=tmp_path,
        )


def test_moving_a_model_with_offloaded_weights_raises(
    checkpoints: dict[tuple[str, str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    device_map = dict.fromkeys(LM_BLOCKS, "cpu") | {"blocks.0": "disk"}
    model = load_checkpoint_and_dispatch(_empty_lm(), checkpoints["lm", "safetensors"], device_map)
    with pytest.raises(RuntimeError, match=r"model.to\(\) cannot move.*'blocks.0.*meta device"):
        model.to("cpu")
    with pytest.raises(RuntimeError, match=r"model.cuda\(\) cannot move"):
        model.cuda()
    with pytest.raises(RuntimeError, match="meta device"):
        model.to(torch.float64)
    remove_hook_from_submodules(model)
    assert "to" not in model.__dict__ and "cuda" not in model.__dict__


def test_moving_a_dispatched_model_without_offload_warns(
    mlp: MLP, caplog: pytest.LogCaptureFixture
) -> None:
    model = _trained(MLP())
    dispatch_model(model, {"fc1": "cpu", "norm": "cpu", "fc2": "cpu"}, force_hooks=True)
    with caplog.at_level(logging.WARNING, logger="accel_bigmodel.dispatch"):
        model.to("cpu")
    assert "moving a model dispatched" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="accel_bigmodel.dispatch"):
        model.to(torch.float32)
    assert "moving a model dispatched" not in caplog.text
    assert torch.equal(model(X), mlp(X))


def test_tensor_level_device_map_keys(lm: TinyLM, checkpoints: dict[tuple[str, str], Path]) -> None:
    device_map = {
        "embed": "cpu",
        "pos": "disk",
        "blocks": "cpu",
        "ln_f.weight": "disk",
        "ln_f.bias": "cpu",
        "lm_head": "cpu",
    }
    model = load_checkpoint_and_dispatch(_empty_lm(), checkpoints["lm", "safetensors"], device_map)
    assert torch.equal(model(IDS), lm(IDS))


def test_preload_module_classes_for_modules_that_read_child_weights(tmp_path: Path) -> None:
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    wrapper = nn.Sequential(attention)
    x = torch.randn(2, 3, 8)
    expected = attention(x, x, x)[0]

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = attention

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attn(x, x, x)[0]

    model = Wrapped()
    dispatch_model(
        model,
        {"attn": "disk"},
        offload_dir=tmp_path,
        preload_module_classes=["MultiheadAttention"],
        force_hooks=True,
    )
    hook = find_align_devices_hook(model.attn)
    assert hook is not None and hook.place_submodules
    assert find_align_devices_hook(model.attn.out_proj) is None
    assert torch.equal(model(x), expected)
    del wrapper


# -- cpu_offload / disk_offload / cpu_offload_with_hook ----------------------------------


def test_cpu_offload(lm: TinyLM) -> None:
    model = _trained(TinyLM())
    expected = model(IDS)
    cpu_offload(model)
    assert model.blocks[0].attn.qkv.weight.device.type == "meta"
    assert has_offloaded_params(model.blocks[0].attn.qkv)
    assert torch.equal(model(IDS), expected)
    assert torch.equal(model(IDS), expected)
    remove_hook_from_submodules(model)
    assert model.blocks[0].attn.qkv.weight.device.type == "cpu"
    assert model.lm_head.weight is model.embed.weight or torch.equal(
        model.lm_head.weight, model.embed.weight
    )
    assert torch.equal(model(IDS), expected)


def test_cpu_offload_with_buffers_and_explicit_state_dict(mlp: MLP) -> None:
    model = _trained(MLP())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    cpu_offload(model, execution_device="cpu", offload_buffers=True, state_dict=state)
    assert model.norm.running_mean is not None
    assert model.norm.running_mean.device.type == "meta"
    assert torch.equal(model(X), mlp(X))


def test_cpu_offload_refuses_meta_weights_without_state_dict() -> None:
    with pytest.raises(ValueError, match="cpu_offload: 'fc1.weight'"):
        cpu_offload(_empty_mlp())


def test_disk_offload_writes_then_reuses_the_folder(mlp: MLP, tmp_path: Path) -> None:
    model = _trained(MLP())
    disk_offload(model, tmp_path)
    assert (tmp_path / "fc1.weight.dat").is_file()
    assert torch.equal(model(X), mlp(X))
    written = (tmp_path / "index.json").stat().st_mtime_ns

    with init_empty_weights():
        again = MLP().eval()
    again.norm.load_state_dict(mlp.norm.state_dict(), assign=True)
    disk_offload(again, tmp_path)
    assert (tmp_path / "index.json").stat().st_mtime_ns == written
    assert torch.equal(again(X), mlp(X))


def test_disk_offload_of_a_model_loaded_to_disk_writes_nothing(
    lm: TinyLM, checkpoints: dict[tuple[str, str], Path], tmp_path: Path
) -> None:
    model = _empty_lm()
    load_checkpoint_in_model(model, checkpoints["lm", "safetensors"], device_map={"": "disk"})
    assert registered_offload_index(model)
    disk_offload(model, tmp_path / "off")
    assert _folder_bytes(tmp_path / "off") == 0
    assert torch.equal(model(IDS), lm(IDS))


def test_cpu_offload_with_hook_chain() -> None:
    first, second, third = _trained(MLP()), nn.Linear(4, 3), nn.Linear(3, 2)
    expected = third(second(first(X)))
    first, hook_1 = cpu_offload_with_hook(first, "cpu")
    second, hook_2 = cpu_offload_with_hook(second, "cpu", prev_module_hook=hook_1)
    third, hook_3 = cpu_offload_with_hook(third, "cpu", prev_module_hook=hook_2)
    assert isinstance(hook_2.hook, CpuOffload) and hook_2.hook.prev_module_hook is hook_1
    assert torch.equal(third(second(first(X))), expected)
    offloaded: list[str] = []
    hook_1.offload = lambda: offloaded.append("first")  # type: ignore[method-assign]
    first.to("meta")  # stands for "still on the accelerator"
    second(torch.randn(2, 4))
    assert offloaded == ["first"]
    hook_3.offload()
    hook_3.remove()
    assert "forward" not in third.__dict__ and not hasattr(third, "_hf_hook")


# -- get_state_dict_offloaded_model ------------------------------------------------------


def test_state_dict_of_an_offloaded_model(
    lm: TinyLM, checkpoints: dict[tuple[str, str], Path]
) -> None:
    device_map = dict.fromkeys(LM_BLOCKS, "disk") | {"ln_f": "cpu"}
    model = load_checkpoint_and_dispatch(_empty_lm(), checkpoints["lm", "safetensors"], device_map)
    state = get_state_dict_offloaded_model(model)
    reference = lm.state_dict()
    assert list(state) == list(reference)
    for name, tensor in reference.items():
        assert torch.equal(state[name], tensor), name
        assert state[name].device.type == "cpu"
    assert model.blocks[0].attn.qkv.weight.device.type == "meta"


def test_state_dict_of_a_preloaded_block(tmp_path: Path) -> None:
    model = _trained(MLP())
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    disk_offload(model, tmp_path, preload_module_classes=["MLP"])
    hook = find_align_devices_hook(model)
    assert isinstance(hook, AlignDevicesHook) and hook.place_submodules
    state = get_state_dict_offloaded_model(model)
    assert state.keys() == reference.keys()
    assert all(torch.equal(state[k], v) for k, v in reference.items())


def test_state_dict_leaves_out_unloaded_meta_tensors(caplog: pytest.LogCaptureFixture) -> None:
    model = _empty_mlp()
    with caplog.at_level(logging.WARNING, logger="accel_bigmodel.whole_model"):
        state = get_state_dict_offloaded_model(model)
    assert "fc1.weight" not in state and "norm.running_mean" in state
    assert "fc1.weight" in caplog.text


def test_offload_dir_accepts_path_objects(mlp: MLP, tmp_path: Path) -> None:
    model = _trained(MLP())
    dispatch_model(
        model, {"fc1": "disk", "norm": "cpu", "fc2": "cpu"}, offload_dir=os.fspath(tmp_path)
    )
    assert torch.equal(model(X), mlp(X))


def test_weights_map_priority(mlp: MLP, tmp_path: Path) -> None:
    """Explicit offload_index > registered in-place entries > offload_dir/index.json."""
    real = tmp_path / "real.safetensors"
    save_file({k: v.contiguous() for k, v in mlp.state_dict().items()}, str(real))
    load_map = {"fc1": "disk", "norm": "cpu", "fc2": "disk"}
    folder = tmp_path / "stale"
    offload_state_dict(folder, {k: torch.zeros_like(v) for k, v in mlp.state_dict().items()})

    model = _empty_mlp()
    load_checkpoint_in_model(model, real, device_map=load_map)
    dispatch_model(model, load_map, offload_dir=folder)
    assert torch.equal(model(X), mlp(X))  # the registry beats the stale folder

    zeros = tmp_path / "zeros.safetensors"
    save_file({"fc2.weight": torch.zeros(4, 16), "fc2.bias": torch.zeros(4)}, str(zeros))
    explicit = {
        name: {"safetensors_file": str(zeros), "weight_name": name}
        for name in ("fc2.weight", "fc2.bias")
    }
    model = _empty_mlp()
    load_checkpoint_in_model(model, real, device_map=load_map)
    dispatch_model(model, load_map, offload_dir=folder, offload_index=explicit)
    assert torch.equal(model(X), torch.zeros(5, 4))  # the explicit index wins


def test_accelerator_main_device_offloads_cpu_blocks(mlp: MLP, tmp_path: Path) -> None:
    """With the main device an accelerator, 'cpu' blocks are offloaded too (meta stands in)."""
    model = _trained(MLP())
    dispatch_model(model, {"fc1": "cpu", "norm": "meta", "fc2": "disk"}, offload_dir=tmp_path)
    blocks = {hook.block_name: hook for hook in get_block_hooks(model)}
    assert blocks["fc1"].offload and blocks["fc1"].execution_device == "meta"
    assert blocks["fc2"].offload and not blocks["norm"].offload
    weights = blocks["fc1"].weights_map
    assert weights is not None and torch.equal(weights["weight"], mlp.fc1.weight)
    assert not (tmp_path / "fc1.weight.dat").exists()  # CPU weights stay in memory
    assert (tmp_path / "fc2.weight.dat").exists()
    assert model.norm.weight.device.type == "meta"
    root = find_align_devices_hook(model)
    assert root is not None and root.io_same_device and root.execution_device == "meta"


def test_non_persistent_buffer_outside_the_map_follows_the_main_device(tmp_path: Path) -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = nn.Linear(2, 2)
            self.register_buffer("mask", torch.tensor([1.0, 0.5]), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x)) * self.mask

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    x = torch.randn(3, 2)
    expected = model(x)
    # "0.mask" is covered by no key (the map names "0"'s children): check_device_map accepts
    # it because it is not in the state dict.
    dispatch_model(model, {"0.a": "cpu", "0.b": "cpu", "1": "disk"}, offload_dir=tmp_path)
    assert torch.equal(model(x), expected)
    assert model[0].mask.device.type == "cpu"


# -- copies: an EMA or a reference model made from a dispatched one ------------------------


def _pickled(model: nn.Module) -> nn.Module:
    return pickle.loads(pickle.dumps(model))


def _saved_whole(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES: dict[str, Callable[[nn.Module], nn.Module]] = {
    "deepcopy": copy.deepcopy,
    "pickle": _pickled,
    "torch.save": _saved_whole,
}


def _offloading_hooks(model: nn.Module) -> list[AlignDevicesHook]:
    hooks = [find_align_devices_hook(module) for module in model.modules()]
    return [hook for hook in hooks if hook is not None and hook.offload]


@pytest.mark.parametrize("how", list(COPIES))
def test_a_copy_of_a_model_dispatched_to_cpu_and_disk_runs_on_its_own(
    mlp: MLP, tmp_path: Path, how: str
) -> None:
    # Accelerate's test: {"linear1": "cpu", "batchnorm": "disk", "linear2": "cpu"}.
    model = dispatch_model(
        _trained(MLP()), {"fc1": "cpu", "norm": "disk", "fc2": "cpu"}, offload_dir=tmp_path
    )
    clone = COPIES[how](model)
    assert torch.equal(clone(X), mlp(X)) and torch.equal(model(X), mlp(X))
    originals, copies = _offloading_hooks(model), _offloading_hooks(clone)
    assert len(copies) == len(originals) == 1  # on a CPU main device, "cpu" blocks just stay
    assert not {id(hook) for hook in copies} & {id(hook) for hook in originals}
    # The copy's move guard follows the copy, and still refuses to move meta weights.
    guard = clone.__dict__["to"]
    assert guard.model is clone
    with pytest.raises(RuntimeError, match=r"model.to\(\) cannot move"):
        clone.to("cpu")
    # The copy owns its in-memory weights: changing them leaves the original alone.
    with torch.no_grad():
        clone.fc1.weight.zero_()
    assert not torch.equal(clone(X), mlp(X))
    assert torch.equal(model(X), mlp(X))


@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("kind", ["sharded", "bin"])
def test_a_copy_of_a_loaded_and_dispatched_model_reads_the_same_files(
    lm: TinyLM, checkpoints: dict[tuple[str, str], Path], tmp_path: Path, how: str, kind: str
) -> None:
    device_map = dict.fromkeys(LM_BLOCKS, "cpu") | {"blocks.0": "disk", "lm_head": "disk"}
    folder = tmp_path / "offload"
    model = load_checkpoint_and_dispatch(
        _empty_lm(), checkpoints["lm", kind], device_map, offload_folder=folder
    )
    written = _folder_bytes(folder)
    clone = COPIES[how](model)
    assert torch.equal(clone(IDS), lm(IDS))
    assert _folder_bytes(folder) == written  # no second copy of the disk weights
    remove_hook_from_submodules(model)
    del model
    assert torch.equal(clone(IDS), lm(IDS))
    assert clone.blocks[0].attn.qkv.weight.device.type == "meta"
