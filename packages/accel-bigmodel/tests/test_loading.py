"""Tests of accel_bigmodel.loading: layouts, device maps, disk offload, safety, memory."""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from accel_bigmodel.empty_init import init_empty_weights
from accel_bigmodel.loading import (
    DISABLE_PROGRESS_BAR_ENV,
    load_checkpoint_in_model,
    load_state_dict,
)
from accel_bigmodel.offload import (
    OffloadedWeightsLoader,
    register_offload_index,
    registered_offload_index,
)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(8, 8)
        self.linear2 = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(torch.relu(self.linear1(x)))


class TinyLM(nn.Module):
    """Tied embedding/head, a BatchNorm (buffers), a 0-d buffer and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(2.0))
        self.register_buffer("cache", torch.zeros(3), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        for block in self.blocks:
            hidden = block(hidden)
        normed = self.norm(hidden.reshape(-1, 8)).reshape(hidden.shape)
        return self.head(normed * self.scale)


def _trained() -> TinyLM:
    torch.manual_seed(0)
    model = TinyLM().eval()
    with torch.no_grad():
        model.norm.running_mean.uniform_(-1, 1)
        model.norm.running_var.uniform_(0.5, 2)
        model.norm.num_batches_tracked.fill_(7)
        model.scale.fill_(1.5)
    return model


def _empty() -> TinyLM:
    with init_empty_weights():
        model = TinyLM().eval()
    # init_empty_weights rebuilds every parameter (as Accelerate's does), so tie again, like
    # transformers' tie_weights() does after building a model on meta.
    model.head.weight = model.embed.weight
    return model


def _checkpoint_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict without the tied duplicate (as safetensors/save_model store it)."""
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    del state["head.weight"]
    return state


def _shard(state: dict[str, torch.Tensor], folder: Path, parts: int, ext: str) -> Path:
    names = list(state)
    weight_map: dict[str, str] = {}
    size = -(-len(names) // parts)
    for number in range(parts):
        chunk = names[number * size : (number + 1) * size]
        filename = f"model-{number + 1:05d}-of-{parts:05d}.{ext}"
        piece = {name: state[name] for name in chunk}
        if ext == "safetensors":
            save_file(piece, str(folder / filename), metadata={"format": "pt"})
        else:
            torch.save(piece, folder / filename)
        weight_map.update(dict.fromkeys(chunk, filename))
    index_name = (
        "model.safetensors.index.json" if ext == "safetensors" else "pytorch_model.bin.index.json"
    )
    index = folder / index_name
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


@pytest.fixture(scope="module")
def reference() -> TinyLM:
    return _trained()


@pytest.fixture(scope="module")
def checkpoints(reference: TinyLM, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    state = _checkpoint_state(reference)
    single = root / "single.safetensors"
    save_file(state, str(single), metadata={"format": "pt"})
    folder = root / "folder"
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    sharded = root / "sharded"
    sharded.mkdir()
    index = _shard(state, sharded, 3, "safetensors")
    binary = root / "model.bin"
    torch.save(reference.state_dict(), binary)
    bin_sharded = root / "bin_sharded"
    bin_sharded.mkdir()
    _shard(state, bin_sharded, 2, "bin")
    return {
        "single": single,
        "folder": folder,
        "index": index,
        "sharded_folder": sharded,
        "bin": binary,
        "bin_sharded": bin_sharded,
    }


def _assert_matches(model: nn.Module, reference: nn.Module) -> None:
    got, want = model.state_dict(), reference.state_dict()
    assert list(got) == list(want)
    for name, value in want.items():
        assert got[name].device.type == "cpu", name
        assert torch.equal(got[name], value), name
    assert model.head.weight is model.embed.weight  # type: ignore[union-attr]


def _run(model: nn.Module, reference: nn.Module) -> None:
    ids = torch.tensor([[1, 5, 9, 15]])
    with torch.no_grad():
        assert torch.equal(model(ids), reference(ids))


@pytest.mark.parametrize(
    "kind", ["single", "folder", "index", "sharded_folder", "bin", "bin_sharded"]
)
def test_every_layout_loads_into_an_empty_model(
    kind: str, checkpoints: dict[str, Path], reference: TinyLM
) -> None:
    model = _empty()
    load_checkpoint_in_model(model, checkpoints[kind])
    _assert_matches(model, reference)
    _run(model, reference)


@pytest.mark.parametrize("kind", ["single", "index", "bin"])
def test_device_map_on_cpu(kind: str, checkpoints: dict[str, Path], reference: TinyLM) -> None:
    model = _empty()
    load_checkpoint_in_model(model, checkpoints[kind], device_map={"": "cpu"})
    _assert_matches(model, reference)
    assert registered_offload_index(model) is None


def test_loading_into_a_real_model_writes_in_place(
    checkpoints: dict[str, Path], reference: TinyLM
) -> None:
    model = TinyLM().eval()
    weight = model.blocks[0].linear1.weight
    storage = weight.data_ptr()
    load_checkpoint_in_model(model, checkpoints["single"])
    assert model.blocks[0].linear1.weight is weight and weight.data_ptr() == storage
    _assert_matches(model, reference)


def test_real_model_keeps_its_dtype_without_device_map(
    checkpoints: dict[str, Path], reference: TinyLM
) -> None:
    model = TinyLM().eval().to(torch.float64)
    load_checkpoint_in_model(model, checkpoints["single"])
    assert model.blocks[1].linear2.weight.dtype == torch.float64
    assert torch.equal(model.blocks[1].linear2.weight, reference.blocks[1].linear2.weight.double())


DISK_MAP = {
    "embed": "cpu",
    "head": "cpu",
    "scale": "cpu",
    "blocks.0": "cpu",
    "blocks.1": "disk",
    "blocks.2": "disk",
    "norm": "disk",
}


def test_safetensors_disk_weights_are_read_in_place(
    checkpoints: dict[str, Path], reference: TinyLM, tmp_path: Path
) -> None:
    model = _empty()
    offload = tmp_path / "offload"
    load_checkpoint_in_model(
        model, checkpoints["index"], device_map=DISK_MAP, offload_folder=offload
    )
    assert os.listdir(offload) == []  # nothing written
    state = model.state_dict()
    disk_params = [
        n
        for n in state
        if n.startswith(("blocks.1.", "blocks.2.", "norm."))
        and "running" not in n
        and "num_batches" not in n
    ]
    for name in disk_params:
        assert state[name].device.type == "meta", name
    for name in ("norm.running_mean", "norm.running_var", "norm.num_batches_tracked"):
        assert torch.equal(state[name], reference.state_dict()[name]), name  # buffers stay in RAM
    assert model.blocks[0].linear1.weight.device.type == "cpu"
    index = registered_offload_index(model)
    assert index is not None and sorted(index) == sorted(disk_params)
    entry = index["blocks.2.linear1.weight"]
    assert os.path.isabs(entry["safetensors_file"])
    assert Path(entry["safetensors_file"]).parent == checkpoints["index"].parent
    assert entry["weight_name"] == "blocks.2.linear1.weight"
    assert entry["dtype"] == "float32" and entry["shape"] == [8, 8]
    loader = OffloadedWeightsLoader(index=index)
    for name in disk_params:
        assert torch.equal(loader[name], reference.state_dict()[name]), name


def test_no_offload_folder_needed_for_safetensors(
    checkpoints: dict[str, Path], reference: TinyLM
) -> None:
    model = _empty()
    load_checkpoint_in_model(model, checkpoints["single"], device_map=DISK_MAP)
    assert registered_offload_index(model) is not None


def test_bin_disk_weights_are_written_like_accelerate(
    checkpoints: dict[str, Path], reference: TinyLM, tmp_path: Path
) -> None:
    model = _empty()
    load_checkpoint_in_model(
        model, checkpoints["bin"], device_map=DISK_MAP, offload_folder=tmp_path
    )
    index = json.loads((tmp_path / "index.json").read_text())
    assert "blocks.1.linear1.weight" in index and "norm.running_mean" not in index
    assert index["blocks.1.linear1.weight"] == {"dtype": "float32", "shape": [8, 8]}
    assert (tmp_path / "index.json").read_text() == json.dumps(index, indent=2)
    loader = OffloadedWeightsLoader(save_folder=tmp_path)
    for name in index:
        assert torch.equal(loader[name], reference.state_dict()[name]), name
        assert (tmp_path / f"{name}.dat").is_file()
    assert registered_offload_index(model) is None


def test_offload_buffers_sends_buffers_to_disk(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    model = _empty()
    load_checkpoint_in_model(
        model, checkpoints["single"], device_map=DISK_MAP, offload_buffers=True
    )
    index = registered_offload_index(model)
    assert index is not None and "norm.running_mean" in index
    assert model.norm.running_mean.device.type == "meta"


def test_dtype_change_on_disk_writes_converted_weights(
    checkpoints: dict[str, Path], reference: TinyLM, tmp_path: Path
) -> None:
    model = _empty()
    load_checkpoint_in_model(
        model, checkpoints["single"], device_map=DISK_MAP, offload_folder=tmp_path, dtype="float16"
    )
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["blocks.1.linear1.weight"]["dtype"] == "float16"
    assert "norm.num_batches_tracked" not in index
    loaded = OffloadedWeightsLoader(save_folder=tmp_path)["blocks.1.linear1.weight"]
    assert torch.equal(loaded, reference.blocks[1].linear1.weight.detach().half())
    assert model.blocks[1].linear1.weight.dtype == torch.float16
    assert model.blocks[0].linear1.weight.dtype == torch.float16
    assert model.norm.num_batches_tracked.dtype == torch.int64


def test_disk_weights_that_must_be_written_need_an_offload_folder(
    checkpoints: dict[str, Path],
) -> None:
    for checkpoint, kwargs in (
        (checkpoints["bin"], {}),
        (checkpoints["single"], {"dtype": torch.float16}),
    ):
        model = _empty()
        with pytest.raises(ValueError, match="offload_folder=None") as info:
            load_checkpoint_in_model(model, checkpoint, device_map=DISK_MAP, **kwargs)
        assert "Pass offload_folder=" in str(info.value)
        assert all(t.device.type == "meta" for t in model.parameters())  # unchanged


def test_dtype_and_keep_in_fp32_modules(checkpoints: dict[str, Path], reference: TinyLM) -> None:
    model = _empty()
    load_checkpoint_in_model(
        model,
        checkpoints["single"],
        device_map={"": "cpu"},
        dtype=torch.float16,
        keep_in_fp32_modules=["blocks.1"],
    )
    assert model.blocks[0].linear1.weight.dtype == torch.float16
    assert model.blocks[1].linear1.weight.dtype == torch.float32
    assert torch.equal(model.blocks[1].linear1.weight, reference.blocks[1].linear1.weight)
    assert model.norm.num_batches_tracked.dtype == torch.int64
    with pytest.raises(ValueError, match="dtype='float17'"):
        load_checkpoint_in_model(_empty(), checkpoints["single"], dtype="float17")


def test_checkpoint_dtype_is_cast_to_the_model_dtype_with_device_map(
    tmp_path: Path, reference: TinyLM
) -> None:
    path = tmp_path / "half.safetensors"
    save_file(
        {
            k: v.half() if v.is_floating_point() else v
            for k, v in _checkpoint_state(reference).items()
        },
        str(path),
    )
    model = _empty()
    load_checkpoint_in_model(model, path, device_map={"": "cpu"})
    assert model.blocks[0].linear1.weight.dtype == torch.float32
    assert torch.equal(
        model.blocks[0].linear1.weight, reference.blocks[0].linear1.weight.half().float()
    )


def test_offload_state_dict_stages_cpu_weights(
    checkpoints: dict[str, Path], reference: TinyLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    staging_root = tmp_path / "tmp"
    staging_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(staging_root))
    for kind in ("single", "bin"):
        model = _empty()
        load_checkpoint_in_model(
            model, checkpoints[kind], device_map={"": "cpu"}, offload_state_dict=True
        )
        _assert_matches(model, reference)
        assert os.listdir(staging_root) == []


def test_shape_mismatch_names_both_shapes_and_changes_nothing(
    tmp_path: Path, reference: TinyLM
) -> None:
    state = _checkpoint_state(reference)
    state["blocks.2.linear2.weight"] = torch.zeros(8, 4)
    path = tmp_path / "bad.safetensors"
    save_file(state, str(path))
    for device_map in (None, {"": "cpu"}, DISK_MAP):
        model = TinyLM()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        objects = [id(p) for p in model.parameters()]
        with pytest.raises(ValueError, match=r"'blocks\.2\.linear2\.weight'.*\(8, 4\).*\(8, 8\)"):
            load_checkpoint_in_model(
                model, path, device_map=device_map, offload_folder=tmp_path / "o"
            )
        assert [id(p) for p in model.parameters()] == objects
        for name, value in model.state_dict().items():
            assert torch.equal(value, before[name]), name
        assert registered_offload_index(model) is None


def test_strict_reports_missing_and_unexpected_keys_before_loading(
    tmp_path: Path, reference: TinyLM
) -> None:
    state = _checkpoint_state(reference)
    del state["blocks.0.linear1.bias"]
    state["extra.weight"] = torch.ones(2)
    path = tmp_path / "keys.safetensors"
    save_file(state, str(path))
    model = _empty()
    with pytest.raises(
        RuntimeError, match=r"missing key\(s\): \['blocks.0.linear1.bias'\]"
    ) as info:
        load_checkpoint_in_model(model, path, strict=True)
    assert "unexpected key(s): ['extra.weight']" in str(info.value)
    assert "head.weight" not in str(info.value)  # tied to the loaded embed.weight
    assert all(p.device.type == "meta" for p in model.parameters())


def test_non_strict_warns_about_unexpected_and_missing(
    tmp_path: Path, reference: TinyLM, caplog: pytest.LogCaptureFixture
) -> None:
    state = _checkpoint_state(reference)
    del state["blocks.0.linear1.bias"]
    state["extra.weight"] = torch.ones(2)
    path = tmp_path / "keys.safetensors"
    save_file(state, str(path), metadata={"format": "pt"})
    model = _empty()
    with caplog.at_level(logging.WARNING, logger="accel_bigmodel.loading"):
        load_checkpoint_in_model(model, path, device_map={"": "cpu"})
    text = caplog.text
    assert "extra.weight" in text and "were not used" in text
    assert "blocks.0.linear1.bias" in text and "were not in the checkpoint" in text
    assert torch.equal(model.blocks[0].linear1.weight, reference.blocks[0].linear1.weight)


def test_missing_metadata_is_warned_once(
    tmp_path: Path, reference: TinyLM, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "shards"
    folder.mkdir()
    state = _checkpoint_state(reference)
    names = list(state)
    save_file({n: state[n] for n in names[:5]}, str(folder / "a.safetensors"))
    save_file({n: state[n] for n in names[5:]}, str(folder / "b.safetensors"))
    weight_map = {n: "a.safetensors" if i < 5 else "b.safetensors" for i, n in enumerate(names)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with caplog.at_level(logging.WARNING, logger="accel_bigmodel.loading"):
        load_checkpoint_in_model(_empty(), folder)
    assert caplog.text.count("has no metadata") == 1


def test_pickles_are_loaded_with_weights_only(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.mkdir, (str(marker),))

    path = tmp_path / "evil.bin"
    torch.save({"embed.weight": torch.zeros(16, 8), "x": Payload()}, path)
    with pytest.raises(pickle.UnpicklingError, match="weights_only=True"):
        load_checkpoint_in_model(_empty(), path)
    with pytest.raises(pickle.UnpicklingError, match="add_safe_globals"):
        load_state_dict(path)
    assert not marker.exists()


def test_legacy_pickle_format_is_still_read(tmp_path: Path, reference: TinyLM) -> None:
    path = tmp_path / "legacy.bin"
    torch.save(reference.state_dict(), path, _use_new_zipfile_serialization=False)
    model = _empty()
    load_checkpoint_in_model(model, path)
    _assert_matches(model, reference)


def test_non_tensor_entries_and_non_mappings_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "list.bin"
    torch.save([torch.ones(1)], path)
    with pytest.raises(ValueError, match="not a state dict"):
        load_state_dict(path)
    path = tmp_path / "mixed.bin"
    torch.save({"embed.weight": torch.zeros(16, 8), "step": 3}, path)
    with pytest.raises(ValueError, match="'step'.*not a tensor"):
        load_checkpoint_in_model(_empty(), path)


def test_bad_checkpoint_paths(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint_in_model(_empty(), tmp_path / "nowhere")
    with pytest.raises(ValueError, match="without pytorch_model.bin"):
        load_checkpoint_in_model(_empty(), tmp_path)
    (tmp_path / "a.index.json").write_text("{}")
    (tmp_path / "b.index.json").write_text("{}")
    with pytest.raises(ValueError, match="more than one '.index.json'"):
        load_checkpoint_in_model(_empty(), tmp_path)
    escape = tmp_path / "escape.index.json"
    escape.write_text(json.dumps({"weight_map": {"embed.weight": "../x.safetensors"}}))
    with pytest.raises(ValueError, match="outside its folder"):
        load_checkpoint_in_model(_empty(), escape)
    gone = tmp_path / "gone.index.json"
    gone.write_text(json.dumps({"weight_map": {"embed.weight": "missing.safetensors"}}))
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint_in_model(_empty(), gone)


def test_device_map_errors_leave_the_model_unchanged(checkpoints: dict[str, Path]) -> None:
    model = _empty()
    with pytest.raises(ValueError, match=r"places no module holding \['blocks\.0\.linear1\.bias'"):
        load_checkpoint_in_model(
            model, checkpoints["single"], device_map={"embed": "cpu", "head": "cpu"}
        )
    with pytest.raises(ValueError, match=r"device_map\['blocks'\]='gpu9'"):
        load_checkpoint_in_model(
            model, checkpoints["single"], device_map={"": "cpu", "blocks": "gpu9"}
        )
    assert all(p.device.type == "meta" for p in model.parameters())


def test_bitsandbytes_offload_is_refused(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(NotImplementedError, match="offload_8bit_bnb=True"):
        load_checkpoint_in_model(_empty(), checkpoints["single"], offload_8bit_bnb=True)


def test_broadcast_needs_a_process_group(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="process group"):
        load_checkpoint_in_model(_empty(), checkpoints["single"], broadcast_from_rank0=True)
    with pytest.raises(ValueError, match="without a device_map"):
        load_checkpoint_in_model(
            _empty(), checkpoints["single"], device_map={"": "cpu"}, broadcast_from_rank0=True
        )


def test_reloading_on_cpu_forgets_stale_registry_entries(checkpoints: dict[str, Path]) -> None:
    model = _empty()
    load_checkpoint_in_model(model, checkpoints["single"], device_map=DISK_MAP)
    assert "blocks.1.linear1.weight" in (registered_offload_index(model) or {})
    load_checkpoint_in_model(model, checkpoints["single"], device_map={"": "cpu"})
    assert registered_offload_index(model) is None


def test_tied_weights_on_disk_share_one_entry(tmp_path: Path, reference: TinyLM) -> None:
    path = tmp_path / "m.safetensors"
    save_file(_checkpoint_state(reference), str(path))
    model = _empty()
    load_checkpoint_in_model(model, path, device_map={"": "disk"})
    index = registered_offload_index(model)
    assert index is not None
    assert index["head.weight"]["weight_name"] == "embed.weight"
    assert model.head.weight is model.embed.weight


def test_tied_weights_stay_tied_on_disk_after_a_dtype_change(
    tmp_path: Path, reference: TinyLM
) -> None:
    model = _empty()
    load_checkpoint_in_model(
        model,
        _save(tmp_path, reference),
        device_map={"": "disk"},
        dtype=torch.float16,
        offload_folder=tmp_path / "o",
    )
    assert model.head.weight is model.embed.weight
    assert model.embed.weight.dtype == torch.float16


def _save(folder: Path, reference: TinyLM) -> Path:
    path = folder / "m.safetensors"
    save_file(_checkpoint_state(reference), str(path))
    return path


def test_register_merges_with_caller_entries(checkpoints: dict[str, Path]) -> None:
    model = _empty()
    register_offload_index(model, {"custom": {"safetensors_file": "/x", "weight_name": "y"}})
    load_checkpoint_in_model(model, checkpoints["single"], device_map=DISK_MAP)
    index = registered_offload_index(model)
    assert index is not None and "custom" in index and "blocks.1.linear1.weight" in index


def test_load_state_dict(checkpoints: dict[str, Path], reference: TinyLM, tmp_path: Path) -> None:
    want = _checkpoint_state(reference)
    for loaded in (
        load_state_dict(checkpoints["single"]),
        load_state_dict(checkpoints["single"], device_map={"blocks": "disk", "": "cpu"}),
    ):
        assert sorted(loaded) == sorted(want)
        for name, value in want.items():
            assert loaded[name].device.type == "cpu" and torch.equal(loaded[name], value), name
    from_bin = load_state_dict(checkpoints["bin"])
    assert torch.equal(from_bin["head.weight"], reference.head.weight)
    for fmt, error in (("tf", ValueError), ("jax", OSError)):
        path = tmp_path / f"{fmt}.safetensors"
        save_file({"a": torch.ones(1)}, str(path), metadata={"format": fmt})
        with pytest.raises(error, match=fmt):
            load_state_dict(path)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_terminal(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("tqdm")
    # Patched in the test body: pytest re-installs its own capture between fixtures and call.
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    load_checkpoint_in_model(_empty(), checkpoints["index"])
    assert "Loading checkpoint weights" in terminal.getvalue()
    terminal.seek(0)
    terminal.truncate()
    monkeypatch.setenv(DISABLE_PROGRESS_BAR_ENV, "1")
    load_checkpoint_in_model(_empty(), checkpoints["index"])
    assert terminal.getvalue() == ""


def test_no_progress_bar_when_not_a_terminal(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    load_checkpoint_in_model(_empty(), checkpoints["index"])
    assert stream.getvalue() == ""


_PEAK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from torch import nn
    from accel_bigmodel.empty_init import init_empty_weights
    from accel_bigmodel.loading import load_checkpoint_in_model

    def high_water_mark():
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024

    layers, width, checkpoint = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    growth = {}
    for mode in ("device_map", "no_device_map"):
        with init_empty_weights():
            model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # reset the peak RSS to the current RSS
        before = high_water_mark()
        device_map = {"": "cpu"} if mode == "device_map" else None
        load_checkpoint_in_model(model, checkpoint, device_map=device_map)
        growth[mode + "_loaded"] = high_water_mark() - before
        # CPU weights may be copy-on-write views of the file, paged in when first used:
        # touch every one, as a forward would.
        total = sum(float(p.sum()) for p in model.parameters())
        growth[mode] = high_water_mark() - before
        assert all(p.device.type == "cpu" for p in model.parameters())
        del model
    print(json.dumps(growth))
    """
)


@pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc peak-RSS reset"
)
def test_peak_memory_is_the_model_plus_one_tensor(tmp_path: Path) -> None:
    layers, width = 12, 2048  # 12 tensors of 16 MiB: a 192 MiB checkpoint in one file
    path = tmp_path / "big.safetensors"
    state = {f"{i}.weight": torch.full((width, width), float(i)) for i in range(layers)}
    save_file(state, str(path), metadata={"format": "pt"})
    del state
    script = tmp_path / "peak.py"
    script.write_text(_PEAK_SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script), str(layers), str(width), str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        # A fixed mmap threshold makes glibc return freed tensors to the OS at once, so the
        # second measurement does not start on top of memory freed but still resident.
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"},
    )
    assert result.returncode == 0, result.stderr
    growth = json.loads(result.stdout.strip().splitlines()[-1])
    model_bytes = layers * width * width * 4
    one_tensor = width * width * 4
    # Loaded but not yet used, the {"": "cpu"} weights are views of the file: nothing read.
    assert growth.pop("device_map_loaded") <= one_tensor, growth
    assert growth.pop("no_device_map_loaded") <= model_bytes + one_tensor + 8 * 2**20, growth
    for mode, grown in growth.items():
        # Streaming holds the model plus at most one tensor; reading the whole file first
        # would add another 192 MiB.
        assert model_bytes - one_tensor <= grown <= model_bytes + one_tensor + 8 * 2**20, (
            mode,
            grown / 2**20,
        )


def test_reloading_forgets_tied_aliases_too(tmp_path: Path, reference: TinyLM) -> None:
    path = _save(tmp_path, reference)
    model = _empty()
    load_checkpoint_in_model(model, path, device_map={"": "disk"})
    assert "head.weight" in (registered_offload_index(model) or {})
    load_checkpoint_in_model(model, path, device_map={"": "cpu"})
    assert registered_offload_index(model) is None
    _assert_matches(model, reference)


def test_buffers_of_disk_modules_keep_the_model_dtype(tmp_path: Path, reference: TinyLM) -> None:
    path = tmp_path / "half.safetensors"
    state = _checkpoint_state(reference)
    save_file({k: v.half() if v.is_floating_point() else v for k, v in state.items()}, str(path))
    model = _empty()
    load_checkpoint_in_model(model, path, device_map=DISK_MAP)
    assert model.norm.running_mean.dtype == torch.float32
    assert torch.equal(model.norm.running_mean, reference.norm.running_mean.half().float())
    index = registered_offload_index(model)
    assert index is not None and index["norm.weight"]["dtype"] == "float16"
    assert model.norm.weight.dtype == torch.float16  # meta, in the dtype it will be served in


def test_accelerator_staging_path(tmp_path: Path, reference: TinyLM) -> None:
    """The read-into-staging-then-copy path used for accelerators, driven with the meta device."""
    from accel_bigmodel.loading.source import Source, Staging

    path = _save(tmp_path, reference)
    staging = Staging()
    source = Source(str(path), staging)
    try:
        value = source.value("blocks.0.linear1.weight", torch.device("meta"), torch.float16)
        assert value.device.type == "meta" and value.dtype == torch.float16
        assert value.shape == (8, 8)
        staged = staging.take(torch.float32, (8, 8))
        assert torch.equal(staged, reference.blocks[0].linear1.weight)  # the bytes went there
        small = staging.take(torch.int64, (2,))
        assert small.data_ptr() == staged.data_ptr()  # one buffer, reused
    finally:
        source.close()


def _distributed_load(path: str) -> dict[str, dict[str, list[float]]]:
    """On each rank: load into an FSDP2 (DTensor) model, and with broadcast_from_rank0."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch 2.5 (the floor) has FSDP2 under its first, private name
        from torch.distributed._composable.fsdp import fully_shard

    from accel_state import PartialState

    PartialState()
    torch.manual_seed(100 + dist.get_rank())  # every rank starts from different weights
    sharded = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    fully_shard(sharded)
    load_checkpoint_in_model(sharded, path)
    full = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True))
    plain = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    load_checkpoint_in_model(plain, path, broadcast_from_rank0=True)
    return {
        "fsdp": {k: v.tolist() for k, v in full.items()},
        "broadcast": {k: v.tolist() for k, v in plain.state_dict().items()},
    }


@pytest.mark.multiprocess
def test_dtensor_models_and_broadcast_from_rank0(tmp_path: Path) -> None:
    from accel_state.testing import run_on_cpu

    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    path = tmp_path / "small.safetensors"
    save_file(source.state_dict(), str(path), metadata={"format": "pt"})
    want = {k: v.tolist() for k, v in source.state_dict().items()}
    for result in run_on_cpu(_distributed_load, str(path)):
        assert result["fsdp"] == want
        assert result["broadcast"] == want
