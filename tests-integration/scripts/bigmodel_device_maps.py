"""Print the device maps, budgets and sizes one library computes for a fixed set of cases.

    python bigmodel_device_maps.py --lib accel|accelerate [--out FILE]

The models are generated from fixed seeds on the meta device (MLPs, nested Sequentials,
transformer-like decoders with tied embeddings, an encoder-decoder with a three-way tie,
buffers, mixed dtypes) and every model meets a set of budgets (GPUs only, GPUs + CPU, CPU
only, forcing disk, size strings, "mps") and options (no_split_module_classes, dtype,
special_dtypes, clean_result=False, offload_buffers, fallback_allocation, low_zero). The
script imports only the library named by ``--lib``, so it runs in either virtualenv, and
writes one JSON object ``{case name: result}``; the integration test compares the two.

Each result is recorded, or ``{"error": <exception type>}`` when the library raises. The
cases avoid most inputs on which Accelerate 1.15 raises or drops a tensor (docs/compat.md):
modules that have children *and* direct buffers, root Sequentials with more than ten
children and tied weights, a tied partner that is a split module's direct parameter,
``fallback_allocation`` where the room left is fractional, and ``"disk"`` keys or
non-contiguous GPU indexes in ``get_balanced_memory``. One case
(``tied_layers[1]/infer/four_gpus/fallback``) makes Accelerate raise IndexError.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# ----------------------------------------------------------------------------- library access


class Library:
    """The functions under comparison, taken from accel_bigmodel or from accelerate."""

    def __init__(self, name: str) -> None:
        if name == "accel":
            from accel_bigmodel.device_map import infer_auto_device_map
            from accel_bigmodel.memory import get_balanced_memory, get_max_memory
            from accel_bigmodel.sizes import (
                CustomDtype,
                calculate_maximum_sizes,
                compute_module_sizes,
            )
        else:
            from accelerate.utils import (
                CustomDtype,
                calculate_maximum_sizes,
                compute_module_sizes,
                get_balanced_memory,
                get_max_memory,
                infer_auto_device_map,
            )
        self.infer_auto_device_map: Callable[..., Any] = infer_auto_device_map
        self.get_balanced_memory: Callable[..., Any] = get_balanced_memory
        self.get_max_memory: Callable[..., Any] = get_max_memory
        self.compute_module_sizes: Callable[..., Any] = compute_module_sizes
        self.calculate_maximum_sizes: Callable[..., Any] = calculate_maximum_sizes
        self.int4: Any = CustomDtype.INT4


# ----------------------------------------------------------------------------- model zoo


class ModelForTest(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(3, 4)
        self.batchnorm = nn.BatchNorm1d(4)
        self.linear2 = nn.Linear(4, 5)


class Rotary(nn.Module):
    """A leaf module with a non-persistent buffer (like rotary embeddings)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.ones(dim // 2), persistent=False)


class Attention(nn.Module):
    def __init__(self, dim: int, rotary: bool) -> None:
        super().__init__()
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim)
        if rotary:
            self.rotary = Rotary(dim)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)


class DecoderBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, rotary: bool) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, rotary)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = FeedForward(dim, hidden)


class Decoder(nn.Module):
    """Embedding, blocks, norm and an lm_head tied to the embedding (optionally)."""

    def __init__(self, rng: random.Random, tie: bool, rotary: bool) -> None:
        super().__init__()
        vocab = rng.randrange(50, 200)
        dim = rng.choice([16, 24, 32])
        hidden = dim * rng.choice([2, 3, 4])
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            DecoderBlock(dim, hidden, rotary) for _ in range(rng.randrange(3, 7))
        )
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("position_ids", torch.arange(rng.randrange(16, 64)))
        if tie:
            self.lm_head.weight = self.embed_tokens.weight


class Stack(nn.Module):
    def __init__(self, dim: int, hidden: int, depth: int) -> None:
        super().__init__()
        self.block = nn.ModuleList(DecoderBlock(dim, hidden, False) for _ in range(depth))
        self.final_layer_norm = nn.LayerNorm(dim)


class EncoderDecoder(nn.Module):
    """A T5-like model: one shared embedding used by the encoder, the decoder and the head."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        vocab = rng.randrange(60, 160)
        dim = rng.choice([16, 32])
        self.shared = nn.Embedding(vocab, dim)
        self.encoder = Stack(dim, dim * 2, rng.randrange(2, 4))
        self.decoder = Stack(dim, dim * 2, rng.randrange(2, 4))
        self.encoder.embed_tokens = self.shared
        self.decoder.embed_tokens = self.shared
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.shared.weight


class Masked(nn.Module):
    """A leaf holding a bool mask (fractional byte size) and an int8 parameter."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.register_buffer("mask", torch.ones(size, dtype=torch.bool))
        self.codes = nn.Parameter(torch.zeros(size, size, dtype=torch.int8), requires_grad=False)


def mlp(rng: random.Random) -> nn.Module:
    widths = [rng.randrange(8, 96) for _ in range(rng.randrange(3, 6))]
    layers: list[nn.Module] = []
    for fan_in, fan_out in zip(widths, widths[1:], strict=False):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def nested(rng: random.Random) -> nn.Module:
    width = rng.randrange(8, 40)
    return nn.Sequential(
        nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)),
        nn.Sequential(
            ModelForTest(),
            nn.Sequential(nn.Linear(width, 2 * width), nn.Linear(2 * width, width)),
        ),
        nn.Sequential(OrderedDict([("norm", nn.LayerNorm(width)), ("out", nn.Linear(width, 3))])),
    )


def three_layers_tied(rng: random.Random) -> nn.Module:
    model = nn.Sequential(
        OrderedDict([(f"layer{i}", ModelForTest()) for i in range(1, rng.randrange(4, 6))])
    )
    model.layer3.linear2.weight = model.layer1.linear2.weight
    return model


def mixed_dtypes(rng: random.Random) -> nn.Module:
    model = nn.Sequential(
        OrderedDict(
            [
                ("embed", nn.Embedding(rng.randrange(40, 90), 16)),
                ("block0", DecoderBlock(16, 48, False)),
                ("block1", DecoderBlock(16, 48, False).to(torch.float16)),
                ("block2", DecoderBlock(16, 48, False).to(torch.bfloat16)),
                ("masked", Masked(rng.randrange(9, 30))),
                ("head", nn.Linear(16, 8).to(torch.float64)),
            ]
        )
    )
    return model


def root_buffers(rng: random.Random) -> nn.Module:
    model = Decoder(rng, tie=False, rotary=True)
    model.register_buffer("causal_mask", torch.ones(32, 32))
    return model


#: name -> (builder, block class names for no_split_module_classes)
MODELS: dict[str, tuple[Callable[[random.Random], nn.Module], list[str]]] = {
    "model_for_test": (lambda rng: ModelForTest(), ["ModelForTest"]),
    "mlp": (mlp, ["Linear"]),
    "nested": (nested, ["ModelForTest"]),
    "tied_layers": (three_layers_tied, ["ModelForTest"]),
    "decoder_tied": (lambda rng: Decoder(rng, tie=True, rotary=True), ["DecoderBlock"]),
    "decoder_untied": (lambda rng: Decoder(rng, tie=False, rotary=False), ["DecoderBlock"]),
    "encoder_decoder": (EncoderDecoder, ["DecoderBlock"]),
    "mixed_dtypes": (mixed_dtypes, ["DecoderBlock"]),
    "root_buffers": (root_buffers, ["DecoderBlock", "Attention"]),
}


def build(name: str, seed: int) -> nn.Module:
    builder = MODELS[name][0]
    with torch.device("meta"):
        return builder(random.Random(seed))


# ----------------------------------------------------------------------------- cases


def budgets(total: float, largest: float) -> dict[str, dict[Any, Any]]:
    t = float(total)
    return {
        "gpus_cpu_disk": {0: int(0.35 * t), 1: int(0.35 * t), "cpu": int(0.2 * t)},
        "gpus_only": {0: int(0.5 * t), 1: int(0.7 * t)},
        "four_gpus": {0: int(0.25 * t), 1: int(0.25 * t), 2: int(0.25 * t), 3: int(t)},
        "gpu_cpu_explicit_disk": {0: int(0.3 * t), "cpu": int(0.5 * t), "disk": int(2 * t)},
        "cpu_only": {"cpu": int(0.6 * t)},
        "strings": {0: f"{0.6 * t / 1000:.3f}KB", 1: f"{t / 1024:.3f}KiB", "cpu": "1GB"},
        "mps": {"mps": int(0.4 * t), "cpu": int(0.5 * t)},
        "largest_plus": {0: int(largest + 0.2 * t), 1: int(largest + 0.2 * t), "cpu": int(t)},
        "zero_gpu": {0: 0, 1: int(0.6 * t), 2: int(0.6 * t)},
        "tiny": {0: int(0.05 * t), 1: int(0.1 * t), "cpu": int(0.1 * t)},
    }


def options(lib: Library, model: nn.Module, no_split: list[str]) -> dict[str, dict[str, Any]]:
    names = [name for name, _ in model.named_parameters()]
    special = {name: torch.float32 for name in names[::3]}
    return {
        "default": {},
        "no_split": {"no_split_module_classes": no_split},
        "float16": {"dtype": torch.float16},
        "unclean": {"clean_result": False},
        "offload_buffers": {"offload_buffers": True},
        "fallback": {"fallback_allocation": True},
        "bf16_special": {"dtype": "bfloat16", "special_dtypes": special},
        "int4_special": {
            "dtype": torch.float16,
            "special_dtypes": {n: lib.int4 for n in names[1::4]},
        },
    }


def jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return [[jsonable(k), jsonable(v)] for k, v in value.items()]
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, torch.device):
        return str(value)
    return value


def device_map_result(device_map: dict[str, Any], ordered: bool) -> Any:
    pairs = [[key, jsonable(device)] for key, device in device_map.items()]
    return pairs if ordered else sorted(pairs)


def covers(model: nn.Module, device_map: dict[str, Any]) -> bool:
    """Whether every tensor of the model (parameters and all buffers) is under a key."""
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    names += [name for name, _ in model.named_buffers(remove_duplicate=False)]
    keys = list(device_map)
    return all(
        any(key == "" or name == key or name.startswith(key + ".") for key in keys)
        for name in names
    )


def run(lib: Library) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for model_name, (_, no_split) in MODELS.items():
        for seed in (0,) if model_name == "model_for_test" else (0, 1):
            model = build(model_name, seed)
            tag = f"{model_name}[{seed}]"
            sizes = lib.compute_module_sizes(model)
            total = sizes[""]
            largest = lib.calculate_maximum_sizes(model)[1][0]
            results[f"{tag}/sizes"] = jsonable(dict(sizes))
            results[f"{tag}/sizes_fp16"] = jsonable(
                dict(lib.compute_module_sizes(model, dtype="float16"))
            )
            results[f"{tag}/maximum_sizes"] = jsonable(lib.calculate_maximum_sizes(model))
            all_options = options(lib, model, no_split)
            results[f"{tag}/sizes_int4_special"] = jsonable(
                dict(lib.compute_module_sizes(model, **all_options["int4_special"]))
            )
            all_budgets = budgets(total, largest)
            for budget_name, budget in all_budgets.items():
                results[f"{tag}/max_memory/{budget_name}"] = jsonable(
                    lib.get_max_memory(dict(budget))
                )
                for option_name, kwargs in all_options.items():
                    if option_name != "default" and budget_name not in (
                        "gpus_cpu_disk",
                        "four_gpus",
                        "largest_plus",
                        "gpu_cpu_explicit_disk",
                        "tiny",
                    ):
                        continue
                    if option_name == "int4_special" and budget_name not in ("gpus_cpu_disk",):
                        continue
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        try:
                            device_map = lib.infer_auto_device_map(model, dict(budget), **kwargs)
                        except Exception as error:  # noqa: BLE001 - recorded, compared
                            results[f"{tag}/infer/{budget_name}/{option_name}"] = {
                                "error": type(error).__name__
                            }
                            continue
                    results[f"{tag}/infer/{budget_name}/{option_name}"] = {
                        "map": device_map_result(device_map, ordered=option_name == "unclean"),
                        "buffer_warning": any("bytes of buffer" in str(w.message) for w in caught),
                        "covers_model": covers(model, device_map),
                    }
            balance_budgets = {
                "two": {0: int(total), 1: int(total), "cpu": int(total)},
                "three": {0: int(0.6 * total), 1: int(0.6 * total), 2: int(0.6 * total)},
                "one": {0: int(total)},
                "small": {0: int(0.7 * total), 1: int(0.7 * total), "cpu": int(0.2 * total)},
                "zero_gpu": {0: 0, 1: int(total), "cpu": int(total)},
                "strings": {0: f"{total / 1000:.2f}KB", 1: f"{total / 1000:.2f}KB"},
            }
            for budget_name, budget in balance_budgets.items():
                for low_zero in (False, True):
                    for split_name, split in (("", None), ("/no_split", no_split)):
                        balanced = lib.get_balanced_memory(
                            model, dict(budget), no_split_module_classes=split, low_zero=low_zero
                        )
                        key = f"{tag}/balanced/{budget_name}/low_zero={low_zero}{split_name}"
                        results[key] = jsonable(balanced)
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            device_map = lib.infer_auto_device_map(
                                model, balanced, no_split_module_classes=split
                            )
                        results[f"{key}/infer"] = device_map_result(device_map, ordered=False)
            results[f"{tag}/balanced/fp16"] = jsonable(
                lib.get_balanced_memory(model, dict(balance_budgets["three"]), dtype=torch.float16)
            )
    return results


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lib", choices=["accel", "accelerate"], required=True)
    parser.add_argument("--out", help="write the JSON here instead of stdout")
    args = parser.parse_args()
    # Planning for GPUs this machine lacks is expected here: keep the log quiet.
    logging.disable(logging.WARNING)
    results = run(Library(args.lib))
    text = json.dumps(results, sort_keys=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text)
    else:
        sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
